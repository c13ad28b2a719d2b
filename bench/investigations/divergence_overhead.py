"""What the divergence check (``collective_timeout``, zero_ext/divergence.py) costs a stage-3 step, measured side by
side in one launch: two copies of the benchmark GPT (fp32 parameters, 2 gloo ranks), one under
``ZeroAdamW(collective_timeout=300)`` (the default: deadline waits and a phase check at the start of every forward
and backward) and one under ``collective_timeout=None`` (plain waits, no phase checks), stepped in alternation.
Also the pieces: one phase check alone, and a tiny all-reduce waited for with and without a deadline.

    python bench/investigations/divergence_overhead.py --rounds 30

Writes ``bench/results/divergence_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness, gpt_model

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

import zero_ext  # noqa: E402


def _run(rank: int, world: int, device: torch.device, rounds: int, batch: int) -> dict:
    cfg = GPTConfig()
    engines = {}
    for name, timeout in (("checked", 300.0), ("plain", None)):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = zero_ext.ZeroAdamW(model.named_parameters(), lr=1e-3, stage=3, module=model,
                                 collective_timeout=timeout)  # fmt: skip
        engines[name] = (model, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)

    def step(name):
        model, opt = engines[name]
        model(x, x).backward()
        opt.step()
        opt.zero_grad()

    contenders = {name: (lambda n=name: harness.timed(lambda: step(n))) for name in engines}
    times = harness.round_robin(contenders, warmup=3, reps=rounds, before=dist.barrier)
    # The pieces, each alternated with its counterpart.
    comm = engines["checked"][1].sharded_state.comm
    watch = comm.watch
    tiny = torch.zeros(3)
    limit = datetime.timedelta(seconds=300)

    def all_reduce(deadline: bool):
        work = dist.all_reduce(tiny, async_op=True)
        work.wait(limit) if deadline else work.wait()

    pieces = harness.round_robin(
        {
            "phase check": lambda: harness.timed(lambda: watch.boundary("forward")),
            "tiny all_reduce, wait(deadline)": lambda: harness.timed(lambda: all_reduce(True)),
            "tiny all_reduce, wait()": lambda: harness.timed(lambda: all_reduce(False)),
        },
        warmup=5,
        reps=200,
        before=dist.barrier,
    )
    for _, opt in engines.values():
        opt.close()
    return {"steps": times, "pieces": pieces}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    args = p.parse_args()
    started = time.time()
    result = harness.launch(_run, 2, "cpu", args.rounds, args.batch)
    meta = harness.meta(torch.device("cpu"))
    meta["command"] = f"python bench/investigations/divergence_overhead.py --rounds {args.rounds} --batch {args.batch}"
    rows = []
    for name, times in {**result["steps"], **result["pieces"]}.items():
        s = harness.summary(times)
        rows.append(
            [name, len(times), f"{s['median_s'] * 1e3:.3f}", f"{s['q1_s'] * 1e3:.3f}", f"{s['q3_s'] * 1e3:.3f}"]
        )
    checked = statistics.median(result["steps"]["checked"])
    plain = statistics.median(result["steps"]["plain"])
    ratios = sorted(c / q for c, q in zip(result["steps"]["checked"], result["steps"]["plain"]))
    body = (
        "Stage 3, fp32 benchmark GPT, 2 gloo ranks, rank 0's times; the two engines step in alternation (each "
        "round: a barrier, then one step of each). Step ratio checked/plain: "
        f"{checked / plain:.3f} (medians); per round median {statistics.median(ratios):.3f}, quartiles "
        f"{ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}.\n\n"
        + harness.markdown_table(["what", "n", "median ms", "q1 ms", "q3 ms"], rows)
        + f"\n\nWall time {time.time() - started:.0f} s.\n"
    )
    payload = {"args": vars(args), **result, "ratio_of_medians": checked / plain}
    for path in harness.write_results("divergence_overhead", meta, payload, body):
        print(path)
    print(body)


if __name__ == "__main__":
    main()
