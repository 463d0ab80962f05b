"""The `servers` rollout engine: rollouts from N `vllm serve` servers over HTTP, weights pushed over vLLM's own
weight-transfer interface (docs/scale.md).

* Generation: token ids in, token ids and the engine's log-prob of every sampled token out
  (`/inference/v1/generate`, served with `--enable-scale-out`), one request per completion with its own seed,
  request i going to server i mod N. Every completion's per-token weight versions must be the version last pushed.
* Weights: vLLM's trainer-side `WeightTransferTrainerFactory` with the backend the servers run (our `exgrpo_gloo`,
  `exgrpo.rollout.weight_transfer`), through `ServerPool`, vLLM's four-method client protocol
  over every server at once. Each push pauses the servers, sends the learner's `pushed_weights` (LoRA merged),
  labels them with the version, reads the version back from every server and asks every server which parameters
  it did not load, then resumes them.
* Under torchrun every rank builds the engine. In sync mode each rank samples its shard from the servers; rank 0
  alone sends the weights, and the push ends with every rank waiting for it (a barrier), so no rank samples before
  the servers hold the new version. In async mode rank 0 alone samples and pushes, from its worker thread, a
  snapshot of the weights every rank helped gather (`push_weights(version, weights)`).

The servers must run with the flags `exgrpo serve` assembles (`exgrpo.rollout.serve`), including
`VLLM_SERVER_DEV_MODE=1` for the weight-transfer and RPC routes; the engine reads each server's configuration
(`/server_info`) when it connects and refuses one that cannot serve the run, saying why. An HTTP error, a refused
connection or a timeout is an EngineError naming the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any, Callable, Iterator, Sequence

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from exgrpo.errors import EngineError
from exgrpo.rollout import weight_transfer
from exgrpo.rollout.base import Rollouts, SamplingSettings
from exgrpo.rollout.weights import check_pushable, pushed_weights

#: what the run needs of a server's vLLM config (`/server_info?config_format=json`), beside the backend and dtype
REQUIRED_SERVER_SETTINGS = {("model_config", "logprobs_mode"): "processed_logprobs",
                            ("model_config", "generation_config"): "vllm"}


def server_refusal(config: dict, backend: str, dtype: str, max_model_len: int | None = None) -> str | None:
    """Why a server whose vLLM config (`/server_info?config_format=json`) is `config` cannot serve a run whose
    weights travel by `backend`, which expects the engine precision `dtype` and (given) sequences of
    `max_model_len` tokens (rollout.max_model_len); None when it can."""
    transfer = (config.get("weight_transfer_config") or {}).get("backend")
    if transfer != backend:
        return (f"runs weight transfer {transfer!r}, not {backend!r}: start it with the flags `exgrpo serve` "
                "assembles (--weight-transfer-config)")
    for (section, key), want in REQUIRED_SERVER_SETTINGS.items():
        if config[section].get(key) != want:
            return (f"runs {section}.{key} = {config[section].get(key)!r}, not {want!r}: start it with the flags "
                    "`exgrpo serve` assembles")
    held = str(config["model_config"]["dtype"]).removeprefix("torch.")
    if held != dtype:
        return f"computes in {held}, the run expects {dtype} (rollout.engine_dtype)"
    served = int(config["model_config"]["max_model_len"])
    if max_model_len is not None and served < max_model_len:
        return (f"serves sequences of at most {served} tokens (its max_model_len), fewer than the run's "
                f"rollout.max_model_len {max_model_len}: start it with `exgrpo serve` and the run's config")
    return None


class ServerPool:
    """N `vllm serve` servers: vLLM's `VLLMWeightSyncClient` protocol (its own HTTP client per server) fanned out
    to all of them in parallel, each server's workers told their own rank offset in the transfer group, plus the
    reads a push is checked with. Every call returns once every server answered; the first failure is an
    EngineError naming its server."""

    def __init__(self, urls: Sequence[str], timeout: float):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.urls, self.timeout = [u.rstrip("/") for u in urls], timeout
        self.clients = [HTTPVLLMWeightSyncClient(url, timeout) for url in self.urls]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.urls))
        self.world_sizes = self._each(lambda j: self._get(j, "get_world_size")["world_size"])

    def _each(self, call: Callable[[int], Any]) -> list:
        """`call(j)` for every server j at once; the results in server order."""
        import requests

        futures = [self._pool.submit(call, j) for j in range(len(self.urls))]
        results = []
        for url, future in zip(self.urls, futures):
            try:
                results.append(future.result())
            except requests.HTTPError as e:
                said = answer(e.response.headers.get("content-type"), e.response.text)
                raise EngineError(f"the vLLM server {url} refused {e.request.path_url}: HTTP "
                                  f"{e.response.status_code}: {said}") from None
            except requests.RequestException as e:
                path = e.request.path_url if e.request is not None else "a request"
                raise EngineError(f"the vLLM server {url} did not answer {path}: {_reason(e)}") from None
        return results

    def _get(self, j: int, path: str) -> Any:
        import requests

        response = requests.get(f"{self.urls[j]}/{path}", timeout=self.timeout)
        response.raise_for_status()
        return _json(self.urls[j], path, response)

    def _post(self, j: int, path: str, body: dict | None = None) -> Any:
        import requests

        response = requests.post(f"{self.urls[j]}/{path}", json=body, timeout=self.timeout)
        response.raise_for_status()
        return _json(self.urls[j], path, response) if response.content else None

    # ---------------------------------------------------------------- vLLM's client protocol
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets = [init_info["rank_offset"] + sum(self.world_sizes[:j]) for j in range(len(self.urls))]
        self._each(lambda j: self.clients[j].init_weight_transfer_engine({**init_info, "rank_offset": offsets[j]}))

    def start_weight_update(self) -> None:
        self._each(lambda j: self.clients[j].start_weight_update())

    def update_weights(self, update_info) -> None:
        self._each(lambda j: self.clients[j].update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda j: self.clients[j].finish_weight_update(weight_version))

    # ---------------------------------------------------------------- around a push
    def pause(self) -> None:
        """Stop scheduling (in-flight requests finish first; a push never overlaps a generation of ours)."""
        self._each(lambda j: self._post(j, "pause?mode=wait"))

    def resume(self) -> None:
        self._each(lambda j: self._post(j, "resume"))

    def label(self, version: str) -> None:
        """Name the weights the servers now hold (the label of the tokens they sample next)."""
        self._each(lambda j: self._post(j, "update_weight_version", {"new_version": version}))

    def versions(self) -> list[str | None]:
        return self._each(lambda j: self._get(j, "weight_info")["weight_version"])

    def missing_weights(self) -> list[list[str]]:
        """Per server, the parameters its last update did not load (over all its workers)."""
        return self._each(lambda j: sorted(set().union(*self._post(
            j, "collective_rpc", {"method": "exgrpo_missing_weights"})["results"])))

    def configs(self) -> list[dict]:
        return self._each(lambda j: self._get(j, "server_info?config_format=json")["vllm_config"])

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def answer(content_type: str | None, text: str) -> str:
    """What a server answered, briefly: a JSON body as it is (cut at 500 characters), anything else by its kind and
    size (a web page would fill the screen and say nothing: the URL is not a vLLM server's)."""
    kind = (content_type or "").split(";")[0].strip()
    if kind == "application/json":
        return text[:500]
    return (f"a {kind or 'untyped'} answer of {len(text)} characters, not a vLLM server's JSON (is the URL that of a "
            "server started with `exgrpo serve`?)")


def _reason(error: Exception) -> str:
    """A failed request's cause in the operating system's words where there are some ("Connection refused: nothing
    listens there"), not urllib3's nested retry report."""
    import re

    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error))
    if found and "refused" in found.group(1):
        return f"{found.group(1)} (nothing listens there: is the server started?)"
    return found.group(1) if found else f"{type(error).__name__}: {error}"


def _json(url: str, path: str, response) -> Any:
    if response.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise EngineError(f"the server {url} answered /{path} with "
                          f"{answer(response.headers.get('content-type'), response.text)}")
    return response.json()


class PolicyWeights(WeightSource):
    """The learner's `pushed_weights` as vLLM's `WeightSource`: `metadata()` from the parameters' own shapes and
    dtypes (a merged LoRA weight has its base's), iteration merging as it goes. Under FSDP it is iterated inside
    the learner's full-weights context, where parameters are whole. While `held` is set (a `copied_weights`
    snapshot), it is the source instead of the model."""

    def __init__(self, model):
        self.model, self.held = model, None

    def metadata(self) -> list[ParamMeta]:
        weights = self.held if self.held is not None else pushed_weights(self.model, merged=False)
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in weights]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.held) if self.held is not None else pushed_weights(self.model)


class ServerEngine:
    """A RolloutEngine over `vllm serve` servers (see the module docstring).

    Args:
        model, tokenizer: the learner's policy (possibly peft-wrapped) and its tokenizer.
        urls: the servers' base URLs (http://host:port).
        backend: the weight-transfer backend the servers run (`exgrpo_gloo`, the one built so far).
        dtype: the engine precision the run expects the servers to compute in ("float32" or "bfloat16").
        transfer_address: this host's address as the servers reach it (the transfer group's rendezvous).
        transfer_port: the rendezvous port on it (0: a free one, bound by rank 0 and told to the servers).
        max_concurrency: requests in flight per server.
        request_timeout: seconds an HTTP request (a generation included) may take.
        sync_timeout: seconds a weight push may take.
        max_model_len: the sequence length the run needs (rollout.max_model_len; None: what the servers serve); a
            server serving shorter ones is refused when the engine connects.
    """

    holds_copy = True
    takes_snapshots = True  # push_weights(version, weights): async mode under torchrun needs it

    def __init__(self, model, tokenizer, urls: Sequence[str], *, backend: str, dtype: str, transfer_address: str,
                 transfer_port: int, max_concurrency: int = 256, request_timeout: float = 3600.0,
                 sync_timeout: float = 120.0, max_model_len: int | None = None):
        check_pushable(model)
        if backend != weight_transfer.GLOO_BACKEND:
            raise EngineError(f"weight transfer {backend}: only {weight_transfer.GLOO_BACKEND} is built so far")
        self.max_concurrency, self.request_timeout = max_concurrency, request_timeout
        eos = tokenizer.eos_token_id
        self.eos_ids = sorted(set(eos if isinstance(eos, list) else [eos]))
        self.rank = torch.distributed.get_rank() if _launched() else 0
        self.servers = ServerPool(urls, timeout=sync_timeout)
        self.transfer = self.weights_version = None
        try:
            self.max_model_len = self._check_servers(backend, dtype, max_model_len)
            init = weight_transfer.GlooTrainerInit(transfer_address, transfer_port, 1 + sum(self.servers.world_sizes),
                                                 timeout_s=sync_timeout, rank=self.rank)
            self.source = PolicyWeights(model)
            self.transfer = WeightTransferTrainerFactory.trainer_init(init, client=self.servers, source=self.source)
            self.push_weights(0)  # the servers may have started from other weights
        except BaseException:
            self.close()
            raise

    def _check_servers(self, backend: str, dtype: str, max_model_len: int | None) -> int:
        """Refuse a server that cannot serve the run, with the reason; the smallest max_model_len of them."""
        configs = self.servers.configs()
        for url, config in zip(self.servers.urls, configs):
            refusal = server_refusal(config, backend, dtype, max_model_len)
            if refusal:
                raise EngineError(f"the vLLM server {url} {refusal}")
        return min(int(config["model_config"]["max_model_len"]) for config in configs)

    def push_weights(self, version: int, weights: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """Send the learner's current weights to every server (rank 0; the other ranks join the gather and wait),
        labelled `version`, and confirm every server holds them. Given `weights` (a `copied_weights` snapshot, on
        rank 0), rank 0 sends those alone: no other rank takes part."""
        if self.rank != 0:
            if weights is not None:
                raise ValueError("a snapshot of the weights is pushed by rank 0 alone")
            self.transfer.send_weights()
        else:
            self.servers.pause()
            self.source.held = weights
            try:
                self.transfer.send_weights()
            finally:
                self.source.held = None
            self.servers.label(str(version))
            self._confirm(version)
            self.servers.resume()
        if weights is None and _launched():
            torch.distributed.barrier()
        self.weights_version = version

    def _confirm(self, version: int) -> None:
        for url, missing in zip(self.servers.urls, self.servers.missing_weights()):
            if missing:
                raise EngineError(f"the weight push did not load {len(missing)} parameters of the vLLM server {url} "
                                  f"(e.g. {', '.join(missing[:3])}): it would sample from old weights")
        for url, held in zip(self.servers.urls, self.servers.versions()):
            if held != str(version):
                raise EngineError(f"the vLLM server {url} reports weights version {held!r} after the push of "
                                  f"version {version}")

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> Rollouts:
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(seeds)} seeds")
        too_long = [len(p) for p in prompt_ids if len(p) + sampling.max_new_tokens > self.max_model_len]
        if too_long:
            raise EngineError(f"a prompt of {too_long[0]} tokens + {sampling.max_new_tokens} new tokens exceeds the "
                              f"servers' max_model_len {self.max_model_len}")
        params = dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
                      max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False, stop_token_ids=self.eos_ids)
        requests = [{"token_ids": list(p), "sampling_params": {**params, "seed": int(s)}}
                    for p, s in zip(prompt_ids, seeds)]
        choices = asyncio.run(self._generate_all(requests)) if requests else []
        version = str(self.weights_version)
        completions, truncated, logprobs = [], [], []
        for i, c in enumerate(choices):
            spans = {span["version"] for span in c.get("weight_versions") or []}
            if spans != {version} and c["token_ids"]:
                raise EngineError(f"the vLLM server {self._url(i)} sampled a completion with weights versions "
                                  f"{sorted(spans)}, not the pushed version {version}")
            completions.append(list(c["token_ids"]))
            truncated.append(c["finish_reason"] == "length")
            logprobs.append([t["logprob"] for t in c["logprobs"]["content"]])
        return Rollouts(completions, truncated, logprobs)

    def _url(self, request: int) -> str:
        return self.servers.urls[request % len(self.servers.urls)]

    async def _generate_all(self, requests: list[dict]) -> list[dict]:
        import aiohttp

        limits = [asyncio.Semaphore(self.max_concurrency) for _ in self.servers.urls]

        async def one(session, i: int, body: dict) -> dict:
            url = self._url(i)
            async with limits[i % len(limits)]:
                try:
                    async with session.post(f"{url}/inference/v1/generate", json=body) as response:
                        text = await response.text()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise EngineError(f"the vLLM server {url} did not answer a generation request: "
                                      f"{type(e).__name__}: {e}") from None
            if response.status != 200:
                raise EngineError(f"the vLLM server {url} refused a generation request: HTTP {response.status}: "
                                  f"{answer(response.headers.get('content-type'), text)}")
            return json.loads(text)["choices"][0]

        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i, body) for i, body in enumerate(requests)))

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None
        self.servers.close()


def _launched() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
