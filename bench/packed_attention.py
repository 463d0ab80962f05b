"""Does computing only the packed mask's blocks pay? The packed layout (one sequence per prompt: the prompt, then its
rows' completions) runs SDPA over a 4D mask, and on CPU its flash kernel also computes the blocks the mask excludes
(each completion against its sequence's other completions). This bench times the update's forward and backward of
one micro-batch (6 prompts x 8 completions, SmolLM2-135M-Instruct with LoRA r 32; the demo's work, completions of
3-24 tokens, and round six's, 10-64 tokens; fp32, and bf16 autocast over a bf16 frozen base as `train.dtype=bf16`
runs it) with SDPA over the mask against an attention that computes the allowed blocks only: each prompt causally
over itself (SDPA), each completion over its prompt and causally over itself (explicit scores, softmax in fp32).
Both give the same values (checked here in fp32). Three alternating repeats; one JSON line to stdout and
bench/results/packed_attention.jsonl.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/packed_attention.py [THREADS]     # ~3 min on 2 cores
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compiled_layers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from exgrpo.config import LoraConfig  # noqa: E402
from exgrpo.learner.forward import pack_rows  # noqa: E402
from exgrpo.learner.learner import store_frozen_linear_weights  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "packed_attention.jsonl"
BLOCKS, REPEATS = "blocks", 3


def blocks_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, segments=None, **kwargs):
    """(S, H, L, D) queries, (S, KV, L, D) keys and values -> (S, L, H, D), the allowed blocks only. `segments`:
    (prompt lengths, [(sequence, first position, length) of each completion]); every sequence starts with its
    prompt."""
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    prompt_lengths, completions = segments
    S, H, L, D = query.shape
    KV, P, C = key.shape[1], max(prompt_lengths), max(n for _, _, n in completions)
    index = torch.tensor([[s * L + start + min(t, n - 1) for t in range(C)] for s, start, n in completions])
    valid = torch.tensor([[t < n for t in range(C)] for _, _, n in completions])
    sequence = torch.tensor([s for s, _, _ in completions])
    prompt = torch.arange(P) < torch.tensor(prompt_lengths)[:, None]  # (S, P)

    def gathered(states, heads):  # (S, heads, L, D) -> (R, heads, C, D)
        return states.transpose(1, 2).reshape(S * L, heads, D)[index].permute(0, 2, 1, 3)

    q = gathered(query, H).unflatten(1, (KV, H // KV))  # (R, KV, G, C, D)
    own_k, own_v = gathered(key, KV)[:, :, None], gathered(value, KV)[:, :, None]
    prompt_k, prompt_v = key[sequence, :, None, :P], value[sequence, :, None, :P]
    scores = torch.cat([(q @ prompt_k.transpose(-1, -2)).float().masked_fill(~prompt[sequence][:, None, None, None],
                                                                             float("-inf")),
                        (q @ own_k.transpose(-1, -2)).float().masked_fill(~torch.ones(C, C).bool().tril(),
                                                                          float("-inf"))], dim=-1)
    weights = torch.softmax(scores * scaling, dim=-1).to(value.dtype)
    out_c = (weights[..., :P] @ prompt_v + weights[..., P:] @ own_v).permute(0, 3, 1, 2, 4).flatten(2, 3)
    out_p = F.scaled_dot_product_attention(query[:, :, :P], key[:, :, :P], value[:, :, :P], is_causal=True,
                                           scale=scaling, enable_gqa=True).transpose(1, 2)  # (S, P, H, D)
    flat_p = (torch.arange(S)[:, None] * L + torch.arange(P))[prompt]
    out = query.new_zeros(S * L, H, D).index_copy(0, flat_p, out_p[prompt]).index_copy(0, index[valid], out_c[valid])
    return out.view(S, L, H, D), None


def micro_batch(tokenizer, shortest: int, longest: int, terms: int):
    """`compiled_layers.micro_batch` (6 additions, each with 8 completions); the packed layout and its segments (one
    sequence per prompt: each prompt's length, each completion's prompt, start and length)."""
    batch = compiled_layers.micro_batch(tokenizer, shortest, longest, terms)
    prompt_width = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    prompt_lengths = batch.attention_mask[::8, :prompt_width].sum(-1).tolist()
    completions = []
    for q, start in enumerate(prompt_lengths):
        for n in batch.completion_mask[8 * q:8 * q + 8].sum(-1).int().tolist():
            completions.append((q, start, n))
            start += n
    packed = pack_rows(batch.input_ids, batch.attention_mask, batch.completion_ids, batch.completion_mask)
    assert len(packed.input_ids) == 6  # one sequence per prompt, as `segments` says
    return packed, batch.completion_ids[batch.completion_mask.bool()], (prompt_lengths, completions)


def update(model, packed, targets, segments, bf16: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward and backward; the log-probs of the completion tokens."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=packed.input_ids, attention_mask=packed.allowed, position_ids=packed.position_ids,
                    use_cache=False, output_hidden_states=True, logits_to_keep=1, segments=segments)
        hidden = out.hidden_states[-1].flatten(0, 1)[packed.predictors]
        logp = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1).gather(-1, targets[:, None])
    logp.sum().backward()
    return time.perf_counter() - started, logp.detach()


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    AttentionInterface.register(BLOCKS, blocks_attention)
    AttentionMaskInterface.register(BLOCKS, sdpa_mask)
    record = {"bench": "packed_attention", "threads": threads}
    for precision in ("fp32", "bf16"):
        model, tokenizer = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
        if precision == "bf16":
            store_frozen_linear_weights(model, torch.bfloat16)
        for setting, shape in (("demo", (3, 24, 2)), ("study", (10, 64, 3))):
            packed, targets, segments = micro_batch(tokenizer, *shape)
            seconds, logp = {"sdpa": [], BLOCKS: []}, {}
            for _ in range(REPEATS):
                for attention in seconds:
                    model.set_attn_implementation(attention)
                    s, logp[attention] = update(model, packed, targets, segments, precision == "bf16")
                    seconds[attention].append(round(s, 2))
            difference = float((logp["sdpa"] - logp[BLOCKS]).abs().max())
            assert precision == "bf16" or difference < 1e-3, difference
            record[f"{setting}/{precision}"] = {**seconds, "max_logprob_difference": round(difference, 5)}
    print(json.dumps(record))
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
