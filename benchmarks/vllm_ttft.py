"""Time to first token and prefill tokens saved with kvtierd, against vLLM without it, same run.

    .venv/bin/python benchmarks/vllm_ttft.py [--layers 32] [--doc-tokens 1536] [--json out.json]

Real vLLM (the CPU build in the venv) serves a random-weight Llama-architecture model of a
realistic shape (~0.4B parameters at the defaults: hidden 1024, 32 layers, GQA 16/4 heads, built
locally, no download) over two prefix-reuse workloads:

* ``documents``: long shared documents, each asked several different questions;
* ``chat``: a multi-turn conversation, each turn's prompt the whole history so far.

Each configuration runs in its own child process (vLLM keeps global state) and first serves every
prompt once (``warm``: with kvtierd this stores the chunks). Then, per prompt, vLLM's own prefix
cache is reset — the prefix left the engine, as when its KV memory was needed for other requests,
or when another instance on the node gets the request — and a 1-token generation is timed: its
wall time is the request's time to first token. ``saved`` is the share of prompt tokens vLLM
reports as cached (kvtierd's external hits), i.e. prefill it did not have to compute.

Configurations: ``vllm`` (no connector: every prefill is computed), ``kvtierd`` (KVTierConnector
through a real daemon), ``vllm-native-cpu`` (vLLM's own CPUOffloadingSpec; its row says why if the
CPU build refuses it). Nothing asserts; a table is printed and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 32000


def make_model(out: Path, layers: int) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=layers, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                            initializer_range=0.02, tie_word_embeddings=False)
    tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def workloads(doc_tokens: int, docs: int, questions: int, turns: int) -> dict[str, list[list[int]]]:
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    documents = []
    for _ in range(docs):
        doc = tokens(doc_tokens)
        documents += [doc + tokens(48) for _ in range(questions)]
    chat, history = [], tokens(doc_tokens // 2)  # a system prompt and a first context
    for _ in range(turns):
        history = history + tokens(96)  # the user's turn
        chat.append(list(history))
        history = history + tokens(64)  # the model's answer becomes history
    return {"documents": documents, "chat": chat}


def child(spec: dict) -> dict:
    """Runs in its own process: one engine configuration over every workload."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model_dir"], skip_tokenizer_init=True, enforce_eager=True,
                  dtype="bfloat16", max_model_len=spec["max_model_len"],
                  kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0)
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the engine refused this configuration: say why
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    out: dict = {}
    for name, prompts in spec["workloads"].items():
        for prompt in prompts:  # warm: compute (and, with a connector, store) every prefix once
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        if spec.get("settle"):
            time.sleep(spec["settle"])  # stores are submitted a step late
        ttft, saved = [], []
        for prompt in prompts:
            llm.reset_prefix_cache()
            started = time.perf_counter()
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
            ttft.append(time.perf_counter() - started)
            saved.append((result[0].num_cached_tokens or 0) / len(prompt))
        out[name] = {"ttft_s": ttft, "saved": saved,
                     "prompt_tokens": sum(len(p) for p in prompts)}
    return {"workloads": out}


def run_child(spec: dict, workdir: Path, name: str) -> dict:
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path), str(out_path)],
                              stdout=fh, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode or not out_path.exists():
        return {"refused": f"exit {proc.returncode}: {log.read_text(errors='replace')[-400:]}"}
    return json.loads(out_path.read_text())


def start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtierd", "serve", "--socket", address,
                             "--cpu-bytes", "4GiB", "--nvme-bytes", "0", "--metrics-addr", "off",
                             "--log-level", "WARNING"])
    sock = Path(address[len("ipc://"):])
    deadline = time.monotonic() + 120
    while not Path(f"{sock}.hs").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kvtierd did not start")
        time.sleep(0.1)
    return proc, address


def summarise(result: dict) -> dict:
    if "refused" in result:
        return result
    rows = {}
    for name, w in result["workloads"].items():
        rows[name] = {"ttft_mean_s": statistics.fmean(w["ttft_s"]),
                      "ttft_p50_s": statistics.median(w["ttft_s"]),
                      "saved": statistics.fmean(w["saved"])}
    return rows


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        Path(sys.argv[3]).write_text(json.dumps(child(json.loads(Path(sys.argv[2]).read_text()))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=1536)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--blocks-per-chunk", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    loads = workloads(args.doc_tokens, args.docs, args.questions, args.turns)
    longest = max(len(p) for ps in loads.values() for p in ps)
    with tempfile.TemporaryDirectory(prefix="kvtierd-ttft-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        make_model(model_dir, args.layers)
        base = {"model_dir": str(model_dir), "workloads": loads,
                "max_model_len": -(-(longest + 64) // 256) * 256, "kv_cache_bytes": 1024**3}
        proc, address = start_daemon(work)
        try:
            kvtier = {"kv_role": "kv_both", "kv_connector": "KVTierConnector",
                      "kv_connector_module_path": "kvtier_client.vllm",
                      "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {
                          "spec_name": "KVTierOffloadingSpec",
                          "spec_module_path": "kvtier_client.vllm", "kvtierd_address": address,
                          "kvtierd_layout_dir": str(work),
                          "blocks_per_chunk": args.blocks_per_chunk}}
            native = {"kv_role": "kv_both", "kv_connector": "OffloadingConnector",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 2 * 1024**3,
                                                    "blocks_per_chunk": args.blocks_per_chunk}}
            results = {
                "vllm": run_child(base, work, "vllm"),
                "kvtierd": run_child({**base, "kv_transfer_config": kvtier, "settle": 2.0}, work,
                                     "kvtierd"),
                "vllm-native-cpu": run_child({**base, "kv_transfer_config": native,
                                              "settle": 2.0}, work, "native"),
            }
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    table = {name: summarise(r) for name, r in results.items()}
    print(f"model: Llama-architecture, hidden 1024, {args.layers} layers, random weights; "
          f"documents {args.docs}x{args.doc_tokens} tokens x {args.questions} questions; "
          f"chat {args.turns} turns")
    print(f"{'workload':<11}{'config':<17}{'TTFT mean':>11}{'TTFT p50':>10}{'saved':>8}"
          f"{'vs vllm':>9}")
    for workload in loads:
        plain = table["vllm"].get(workload, {}).get("ttft_mean_s")
        for name, rows in table.items():
            if "refused" in rows:
                print(f"{workload:<11}{name:<17}  refused: {rows['refused'][:120]}")
                continue
            r = rows[workload]
            speedup = f"{plain / r['ttft_mean_s']:.2f}x" if plain else "-"
            print(f"{workload:<11}{name:<17}{r['ttft_mean_s']:>10.3f}s{r['ttft_p50_s']:>9.3f}s"
                  f"{r['saved']:>8.0%}{speedup:>9}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "raw": results, "table": table}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
