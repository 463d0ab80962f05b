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
from exgrpo.rollout.base import Rollouts, SamplingSettings, Weights, check_requests, eos_token_ids, vllm_sampling
from exgrpo.rollout.push import Push
from exgrpo.rollout.weights import base_model, check_pushable, pushed_weights
from exgrpo.runtime.distributed import in_process_group

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


def learner_signature(model) -> dict:
    """The learner's `model_signature`; a model built in process has no `architectures` yet: its class names it."""
    base = base_model(model)
    signature = weight_transfer.model_signature(base.config)
    return {**signature, "architectures": signature["architectures"] or [type(base).__name__]}


def model_refusal(served: dict, learner: dict) -> str | None:
    """Why a server whose model has the `model_signature` `served` cannot take the weights of a learner whose model
    has `learner`; None when it can."""
    differ = [f"{field} {served.get(field)!r}, not {value!r}" for field, value in learner.items()
              if served.get(field) != value]
    if differ:
        return (f"serves another model than the learner's ({'; '.join(differ)}): start it with `exgrpo serve` and "
                "the run's config")
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

    def signatures(self) -> list[dict]:
        """Per server, its model's `model_signature` (from its first worker)."""
        return self._each(lambda j: self._post(j, "collective_rpc", {"method": "exgrpo_model_signature"})
                          ["results"][0])

    def unreachable(self, timeout: float = 5.0) -> list[str]:
        """The servers that do not answer /health within `timeout` seconds."""
        import requests

        def answers(url: str) -> bool:
            try:
                return requests.get(f"{url}/health", timeout=timeout).ok
            except requests.RequestException:
                return False

        return [url for url, ok in zip(self.urls, self._pool.map(answers, self.urls)) if not ok]

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


#: the weights version a server is labelled with while a push writes into it: a server still labelled so was left
#: half loaded by a push that failed or was interrupted
PUSH_IN_PROGRESS = "exgrpo: push in progress"


def restart_advice(urls: Sequence[str]) -> str:
    return (f"restart {'it' if len(urls) == 1 else 'them'} (exgrpo serve) before the next run: a half-loaded model "
            "cannot take another push")


class ServerTransport:
    """The learner's weights to every server at once (`exgrpo_gloo`): rank 0 pauses the servers, labels them
    `PUSH_IN_PROGRESS`, broadcasts (the other ranks only iterate the source: under FSDP that is their part of the
    gather), labels them with the version and resumes them. A failed send names the servers that stopped answering,
    and says that servers left half loaded must be restarted."""

    def __init__(self, servers: ServerPool, transfer, source: PolicyWeights, rank: int):
        self.servers, self.transfer, self.source, self.rank = servers, transfer, source, rank
        self.targets = [f"the vLLM server {url}" for url in servers.urls] if rank == 0 else []

    def send(self, version: int, snapshot: Weights | None) -> None:
        if self.rank != 0:
            if snapshot is not None:
                raise ValueError("a snapshot of the weights is pushed by rank 0 alone")
            self.transfer.send_weights()
            return
        self.servers.pause()
        self.servers.label(PUSH_IN_PROGRESS)
        self.source.held = snapshot
        try:
            self.transfer.send_weights()
        except BaseException as e:
            dead = self.servers.unreachable()
            raise EngineError(f"the weight push failed midway: {_push_failure(e, dead)}; the servers "
                              f"{', '.join(self.servers.urls)} hold half-loaded weights: "
                              f"{restart_advice(self.servers.urls)}") from e
        finally:
            self.source.held = None
        self.servers.label(str(version))
        self.servers.resume()

    def unloaded(self) -> list[list[str]]:
        return self.servers.missing_weights() if self.rank == 0 else []

    def versions(self) -> list[str | None]:
        return self.servers.versions() if self.rank == 0 else []

    def close(self) -> None:
        self.transfer.shutdown()


def _push_failure(error: BaseException, dead: list[str]) -> str:
    """Why a push failed: the servers that died during it, before any error a server still alive reported about
    waiting for them."""
    if dead:
        return f"the vLLM server{'s' if len(dead) > 1 else ''} {', '.join(dead)} stopped answering (died?)"
    return f"{type(error).__name__}: {error}"


class ServerEngine:
    """A RolloutEngine and WeightReceiver over `vllm serve` servers (see the module docstring).

    Args:
        model, tokenizer: the learner's policy (possibly peft-wrapped) and its tokenizer.
        urls: the servers' base URLs (http://host:port).
        backend: the weight-transfer backend the servers run (`exgrpo_gloo`, the one built so far).
        dtype: the engine precision the run expects the servers to compute in ("float32" or "bfloat16").
        transfer_address: this host's address as the servers reach it (the transfer group's rendezvous).
        transfer_port: the rendezvous port on it (0: a free one, bound by rank 0 and told to the servers).
        max_concurrency: requests in flight per server.
        request_timeout: seconds an HTTP request (a generation included) may take.
        push_timeout: seconds a weight push may take (each of its HTTP requests and the broadcast).
        max_model_len: the sequence length the run needs (rollout.max_model_len; None: what the servers serve); a
            server serving shorter ones is refused when the engine connects.
    """

    holds_copy = reports_logprobs = True
    takes_snapshots = True  # async mode under torchrun pushes rank 0's snapshot

    def __init__(self, model, tokenizer, urls: Sequence[str], *, backend: str, dtype: str, transfer_address: str,
                 transfer_port: int, max_concurrency: int = 256, request_timeout: float = 3600.0,
                 push_timeout: float = 120.0, max_model_len: int | None = None):
        check_pushable(model)
        if backend != weight_transfer.GLOO_BACKEND:
            raise EngineError(f"weight transfer {backend}: only {weight_transfer.GLOO_BACKEND} is built so far")
        self.max_concurrency, self.request_timeout = max_concurrency, request_timeout
        self.eos_ids = eos_token_ids(tokenizer)
        self.rank = torch.distributed.get_rank() if in_process_group() else 0
        self.servers = ServerPool(urls, timeout=push_timeout)
        self.push = self.weights_version = None
        try:
            self.max_model_len = self._check_servers(model, backend, dtype, max_model_len)
            init = weight_transfer.GlooSenderInit(transfer_address, transfer_port, 1 + sum(self.servers.world_sizes),
                                                  timeout_s=push_timeout, rank=self.rank)
            source = PolicyWeights(model)
            transfer = WeightTransferTrainerFactory.trainer_init(init, client=self.servers, source=source)
            # bounded by its own HTTP and broadcast timeouts, so that a failure names its server
            self.push = Push(ServerTransport(self.servers, transfer, source, self.rank), timeout=None)
            self.push_weights(0)  # the servers may have started from other weights
        except BaseException:
            self.close()
            raise

    def _check_servers(self, model, backend: str, dtype: str, max_model_len: int | None) -> int:
        """Refuse a server that cannot serve the run, with the reason; the smallest max_model_len of them."""
        configs = self.servers.configs()
        signature = learner_signature(model)
        for url, config, served, version in zip(self.servers.urls, configs, self.servers.signatures(),
                                                self._labels()):
            half_loaded = version == PUSH_IN_PROGRESS
            refusal = server_refusal(config, backend, dtype, max_model_len) or model_refusal(served, signature) \
                or (half_loaded and "holds half-loaded weights: a weight push into it failed or was interrupted; "
                    f"{restart_advice([url])}")
            if refusal:
                raise EngineError(f"the vLLM server {url} {refusal}")
        return min(int(config["model_config"]["max_model_len"]) for config in configs)

    def _labels(self) -> list[str | None]:
        """The servers' weights versions as rank 0 reads them before its first push, on every rank (a rank reading
        them itself could see that push under way): every rank refuses a half-loaded server at once, in one line,
        before any rank waits in a collective of the push."""
        labels = [self.servers.versions() if self.rank == 0 else None]
        if in_process_group():
            torch.distributed.broadcast_object_list(labels, src=0)
        return labels[0]

    def push_weights(self, version: int, snapshot: Weights | None = None) -> None:
        """Send the learner's current weights to every server (rank 0; the other ranks join the gather and wait),
        labelled `version`, and confirm every server holds them. Given a `snapshot` (on rank 0), rank 0 sends it
        alone: no other rank takes part."""
        self.push(version, snapshot)
        if snapshot is None and in_process_group():
            torch.distributed.barrier()  # no rank samples before the servers hold the new version
        self.weights_version = version

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> Rollouts:
        check_requests(prompt_ids, sampling, seeds, self.max_model_len, "the servers")
        requests = [{"token_ids": list(p), "sampling_params": vllm_sampling(sampling, s, self.eos_ids)}
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
        if self.push is not None:
            self.push.close()
            self.push = None
        self.servers.close()

