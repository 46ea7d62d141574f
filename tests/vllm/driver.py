"""Run real vLLM (CPU build) against kvtierd in its own process; the tests read its JSON answer.

vLLM runs outside the pytest process on purpose: it installs loggers, signal handlers and global
state, and its imports warn (the suite turns warnings into errors). Usage::

    python driver.py SPEC.json OUT.json

SPEC: ``model_dir``, ``kind`` (the tiny model to generate there if absent), ``address``,
``layout_dir``, ``prompts`` (token id lists), ``max_tokens``, ``rounds`` (each ``{"name", "env"}``,
every round after the first starts with ``reset_prefix_cache()`` unless it says ``"reset": false``), optional ``extra_config``
(replaces ``blocks_per_chunk``), ``connector`` (replaces ``"kv_connector": "OffloadingConnector"``),
``engine`` (more ``LLM`` arguments, e.g. ``mamba_cache_mode``), ``dtype`` (default bfloat16). OUT: per round the tokens, logprobs and prefix-cache counter deltas,
the layouts the workers published, or ``refused`` with the error if the engine did not start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VOCAB = 1024
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False)
SWA = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def make_model(kind: str, out: Path) -> None:
    """A tiny random-weight model (bf16 safetensors, init std 0.02) saved where vLLM loads it."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 2}))
    elif kind == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**COMMON, layer_types=SWA,
                                                          sliding_window=128))
    elif kind == "gemma4":
        # full layers have a larger head_dim than sliding ones: vLLM then gives the sliding group
        # 256 tokens per block and the full group 128 (equal page bytes)
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
            **COMMON, global_head_dim=64, layer_types=SWA, sliding_window=128,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=0, attention_k_eq_v=False))
    elif kind == "granite4h":
        # Granite-4.0-H's shape (Mamba2 + attention layers, dense MLP), tiny
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
            **{k: v for k, v in COMMON.items() if k != "head_dim"},
            layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
            shared_intermediate_size=256, position_embedding_type="rope", mamba_n_heads=8,
            mamba_n_groups=1, mamba_d_state=16, mamba_d_head=32, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=256))
    elif kind == "qwen3next":
        # Qwen3-Next's shape (3 Gated DeltaNet layers per full-attention layer, MoE), tiny; the CPU
        # GDN kernel needs Qwen3-Next's real 128-wide linear-attention heads
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **{**COMMON, "head_dim": 64},
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, num_experts_per_tok=2, num_experts=4))
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def counters(llm) -> dict[str, float]:
    names = ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")
    return {m.name: m.value for m in llm.get_metrics() if m.name in names}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    model_dir = Path(spec["model_dir"])
    if not (model_dir / "config.json").exists():
        make_model(spec["kind"], model_dir)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier_client.vllm",
             "kvtierd_address": spec["address"], "kvtierd_layout_dir": spec["layout_dir"],
             **spec.get("extra_config", {"blocks_per_chunk": 2})}
    started = time.monotonic()
    try:
        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                  dtype=spec.get("dtype", "bfloat16"), max_model_len=1024, kv_cache_memory_bytes=64 * 2**20,
                  disable_log_stats=False, seed=0, **spec.get("engine", {}),
                  kv_transfer_config={"kv_role": "kv_both", "kv_connector_extra_config": extra,
                                      **spec.get("connector", {"kv_connector": "OffloadingConnector"})})
    except Exception as exc:  # the engine refused its configuration: report it
        Path(out_path).write_text(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
        return
    result = {"init_s": time.monotonic() - started, "rounds": {},
              "layouts": [json.loads(p.read_text())
                          for p in sorted(Path(spec["layout_dir"]).glob("kvtier-vllm-*.json"))]}
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=0,
                            ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    for i, round_ in enumerate(spec["rounds"]):
        os.environ.pop("KVTIER_TEST_LOAD_NEIGHBOUR_CHUNK", None)
        os.environ.update(round_.get("env", {}))
        if i and round_.get("reset", True):
            llm.reset_prefix_cache()
        before = counters(llm)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = counters(llm)
        result["rounds"][round_["name"]] = {
            "seconds": time.monotonic() - t0,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                          o.outputs[0].token_ids)] for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "local_hits": after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"],
            "external_hits": (after["vllm:external_prefix_cache_hits"]
                              - before["vllm:external_prefix_cache_hits"]),
        }
        if round_.get("settle"):
            settle(spec["address"])
    Path(out_path).write_text(json.dumps(result))


def settle(address: str, timeout_s: float = 20.0) -> None:
    """Wait until the daemon's chunk count stops moving (vLLM submits stores a step late)."""
    from kvtierd.control import call
    from kvtierd.protocol import Op

    def chunks() -> tuple:
        tiers = call(address, Op.STATS)["stats"]["tiers"]
        return tiers["cpu"]["chunks"], tiers["cpu"]["pending_chunks"]

    deadline = time.monotonic() + timeout_s
    last = chunks()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = chunks()
        if now == last and now[1] == 0:
            return
        last = now


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
