"""Time to first token and prefill tokens saved with kvtierd, against vLLM without it, same run.

    .venv/bin/python benchmarks/vllm_ttft.py [--budget-s 600] [--doc-tokens N] [--json out.json]
    .venv/bin/python benchmarks/vllm_ttft.py --quick     # tiny model: checks the script only

Real vLLM (the CPU build in the venv) serves a random-weight Llama-architecture model of a
realistic shape (~0.43B parameters at the defaults: hidden 1024, 32 layers, GQA 16/4 heads of 64,
MLP 2816, vocabulary 32000, bf16; built locally, no download) over two prefix-reuse workloads:

* ``documents``: long shared documents, each asked several different questions (48 tokens);
* ``chat``: a multi-turn conversation (96-token user turns, 64-token answers), each turn's prompt
  the whole history so far, starting from a context of half a document.

Each configuration runs in its own child process (vLLM keeps global state); those with an
offloading connector first serve every prompt once (``warm``: with kvtierd this stores the
chunks), plain vLLM only a short warm-up request. Then, per prompt, vLLM's own prefix
cache is reset — the prefix left the engine, as when its KV memory was needed for other requests,
or when another instance on the node gets the request — and a 1-token generation is timed: its
wall time is the request's time to first token. ``saved`` is the share of prompt tokens vLLM
reports as cached (``num_cached_tokens``; all of them come from kvtierd after the reset), i.e.
prefill it did not compute; ``computed`` is the prompt tokens it did compute in the timed pass.

Configurations: ``vllm`` (no connector: every prefill is computed), ``kvtierd`` (KVTierConnector
through a real daemon), ``vllm-native-cpu`` (vLLM's own CPU offloading; its row shows the error if
the CPU build refuses it).

Bounded: unless ``--doc-tokens`` is given, a calibration child first measures this machine's
prefill speed (tokens/s on a 256-token prompt) and engine start time, and the document length is
the largest multiple of 128 whose estimated run fits ``--budget-s`` (printed with the estimate).
Nothing asserts; a table is printed and written as JSON to ``--json`` (default
``benchmarks/results/vllm_ttft.json``).
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
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB = 32000
QUESTION, USER_TURN, ANSWER = 48, 96, 64
CALIBRATION_TOKENS = 256
DEFAULT_JSON = Path(__file__).parent / "results" / "vllm_ttft.json"


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 1024
    heads: int = 16  # of 64 dims
    kv_heads: int = 4
    intermediate: int = 2816

    @property
    def params(self) -> int:
        head = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + 2 * VOCAB * self.hidden


QUICK_SHAPE = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256)


def make_model(out: Path, shape: Shape) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=shape.hidden,
                            intermediate_size=shape.intermediate,
                            num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                            num_key_value_heads=shape.kv_heads,
                            head_dim=shape.hidden // shape.heads, max_position_embeddings=16384,
                            initializer_range=0.02, tie_word_embeddings=False)
    tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def workloads(doc_tokens: int, docs: int, questions: int, turns: int) -> dict[str, list[list[int]]]:
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    documents = []
    for _ in range(docs):
        doc = tokens(doc_tokens)
        documents += [doc + tokens(QUESTION) for _ in range(questions)]
    chat, history = [], tokens(doc_tokens // 2)  # a system prompt and a first context
    for _ in range(turns):
        history = history + tokens(USER_TURN)
        chat.append(list(history))
        history = history + tokens(ANSWER)  # the model's answer becomes history
    return {"documents": documents, "chat": chat}


def estimate_s(doc_tokens: int, args: argparse.Namespace, tokens_per_s: float,
               init_s: float) -> float:
    """Seconds the three configurations should take: engine starts plus every prefill token.

    vllm: no warm pass (nothing to store; the prefix cache is reset before each timed prompt),
    the timed pass computes every prompt whole. kvtierd: the warm pass computes each shared prefix
    once, the timed pass about one block per prompt. vllm-native-cpu: as kvtierd."""
    loads = workloads(doc_tokens, args.docs, args.questions, args.turns)
    prompts = [p for ps in loads.values() for p in ps]
    every = sum(len(p) for p in prompts)
    unique = (args.docs * (doc_tokens + args.questions * QUESTION)
              + len(loads["chat"][-1]))
    tail = 128 * len(prompts)
    return 3 * init_s + (2 * (unique + tail) + every) / tokens_per_s


def child(spec: dict) -> dict:
    """Runs in its own process: one engine configuration over every workload (or calibration)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model_dir"], skip_tokenizer_init=True, enforce_eager=True,
                  dtype="bfloat16", max_model_len=spec["max_model_len"],
                  kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0)
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the engine refused this configuration: say why
        return {"refused": f"{type(exc).__name__}: {exc}"[:300]}
    init_s = time.perf_counter() - started
    block = llm.llm_engine.vllm_config.cache_config.block_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def first_token(prompt: list[int]) -> tuple[float, int]:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        return time.perf_counter() - t0, result[0].num_cached_tokens or 0

    if "calibrate" in spec:
        prompt = random.Random(3).choices(range(3, VOCAB), k=spec["calibrate"])
        first_token(prompt[:32])  # the first request of an engine pays for its warm-up
        seconds = first_token(prompt)[0]
        return {"init_s": init_s, "tokens_per_s": len(prompt) / seconds, "block_size": block}
    out: dict = {}
    if not spec.get("warm", True):  # nothing to store: only the engine's first-request warm-up
        first_token(random.Random(5).choices(range(3, VOCAB), k=64))
    for name, prompts in spec["workloads"].items():
        for prompt in prompts if spec.get("warm", True) else ():
            # warm: compute (and, with a connector, store) every prefix once
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        if spec.get("settle"):
            settle(spec["settle"])  # stores are submitted a step late
        time.sleep(spec.get("pause", 0))  # native offloading: no daemon to ask
        ttft, cached = zip(*(first_token(p) for p in prompts))
        out[name] = {"ttft_s": list(ttft), "cached_tokens": list(cached),
                     "prompt_tokens": [len(p) for p in prompts]}
    return {"workloads": out, "init_s": init_s, "block_size": block}


def settle(address: str, timeout_s: float = 60.0) -> None:
    """Wait until the daemon's chunk count stops moving and nothing is pending, so the timed
    pass finds every store done however slow the machine is."""
    from kvtierd.control import call
    from kvtierd.protocol import Op

    def chunks() -> tuple[int, int]:
        cpu = call(address, Op.STATS)["stats"]["tiers"]["cpu"]
        return cpu["chunks"], cpu["pending_chunks"]

    deadline = time.monotonic() + timeout_s
    last = chunks()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = chunks()
        if now == last and now[1] == 0:
            return
        last = now


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


def start_daemon(workdir: Path, cpu_bytes: str) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtierd", "serve", "--socket", address,
                             "--cpu-bytes", cpu_bytes, "--nvme-bytes", "0", "--metrics-addr",
                             "off", "--log-level", "WARNING"])
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
        prompt, cached = sum(w["prompt_tokens"]), sum(w["cached_tokens"])
        rows[name] = {"ttft_mean_s": statistics.fmean(w["ttft_s"]),
                      "ttft_p50_s": statistics.median(w["ttft_s"]),
                      "saved": cached / prompt, "computed_tokens": prompt - cached,
                      "prompt_tokens": prompt}
    return rows


def choose_doc_tokens(args: argparse.Namespace, work: Path, base: dict) -> tuple[int, dict]:
    """Calibrate, then the longest document (multiple of 128, 256..8192) that fits the budget."""
    started = time.monotonic()
    cal = run_child({**base, "calibrate": CALIBRATION_TOKENS,
                     "max_model_len": 2 * CALIBRATION_TOKENS}, work, "calibrate")
    if "refused" in cal:
        raise RuntimeError(f"calibration failed: {cal['refused']}")
    left = args.budget_s - (time.monotonic() - started)
    doc = 256
    while doc < 8192 and estimate_s(doc + 128, args, cal["tokens_per_s"], cal["init_s"]) <= left:
        doc += 128
    cal["doc_tokens"] = doc
    cal["estimate_s"] = estimate_s(doc, args, cal["tokens_per_s"], cal["init_s"])
    cal["calibration_s"] = time.monotonic() - started
    return doc, cal


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        Path(sys.argv[3]).write_text(json.dumps(child(json.loads(Path(sys.argv[2]).read_text()))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--doc-tokens", type=int, help="fixed document length (no calibration)")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="the whole run's target, calibration included (default 600)")
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--blocks-per-chunk", type=int, default=1,
                        help="vLLM's CPU build has 128-token blocks: 1 = 128-token chunks")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and short prompts: checks the script, measures nothing")
    args = parser.parse_args()
    shape = Shape(layers=args.layers)
    if args.quick:
        shape, args.docs, args.questions, args.turns = QUICK_SHAPE, 1, 2, 2
        args.doc_tokens = args.doc_tokens or 256
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtierd-ttft-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        make_model(model_dir, shape)
        base = {"model_dir": str(model_dir), "kv_cache_bytes": 1024**3}
        calibration = None
        if args.doc_tokens is None:
            args.doc_tokens, calibration = choose_doc_tokens(args, work, base)
            print(f"calibration: {calibration['tokens_per_s']:.0f} prefill tokens/s, engine start "
                  f"{calibration['init_s']:.0f} s -> documents of {args.doc_tokens} tokens, "
                  f"estimated {calibration['estimate_s']:.0f} s for the three configurations",
                  flush=True)
        loads = workloads(args.doc_tokens, args.docs, args.questions, args.turns)
        longest = max(len(p) for ps in loads.values() for p in ps)
        base |= {"workloads": loads, "max_model_len": -(-(longest + 64) // 256) * 256}
        proc, address = start_daemon(work, "1GiB")
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
                "vllm": run_child({**base, "warm": False}, work, "vllm"),
                "kvtierd": run_child({**base, "kv_transfer_config": kvtier, "settle": address},
                                     work, "kvtierd"),
                "vllm-native-cpu": run_child({**base, "kv_transfer_config": native, "pause": 2.0},
                                             work, "native"),
            }
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    elapsed = time.monotonic() - started
    table = {name: summarise(r) for name, r in results.items()}
    block = next((r["block_size"] for r in results.values() if "block_size" in r), None)
    print(f"model: Llama-architecture, {shape.params / 1e9:.2f}B parameters ({asdict(shape)}), "
          f"random weights, bf16; vLLM block {block} tokens, blocks_per_chunk "
          f"{args.blocks_per_chunk}")
    print(f"documents: {args.docs} x {args.doc_tokens} tokens x {args.questions} questions of "
          f"{QUESTION}; chat: {args.turns} turns from a {args.doc_tokens // 2}-token context; "
          f"run {elapsed:.0f} s")
    print(f"{'workload':<11}{'config':<17}{'TTFT mean':>11}{'TTFT p50':>10}{'saved':>8}"
          f"{'computed':>10}{'vs vllm':>9}")
    for workload in loads:
        plain = table["vllm"].get(workload, {}).get("ttft_mean_s")
        for name, rows in table.items():
            if "refused" in rows:
                print(f"{workload:<11}{name:<17}  refused: {rows['refused'][:120]}")
                continue
            r = rows[workload]
            speedup = f"{plain / r['ttft_mean_s']:.2f}x" if plain else "-"
            print(f"{workload:<11}{name:<17}{r['ttft_mean_s']:>10.3f}s{r['ttft_p50_s']:>9.3f}s"
                  f"{r['saved']:>8.0%}{r['computed_tokens']:>10}{speedup:>9}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                     "shape": asdict(shape), "calibration": calibration,
                                     "elapsed_s": elapsed, "raw": results, "table": table},
                                    indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
