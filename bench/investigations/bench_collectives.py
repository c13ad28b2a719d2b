"""The collectives behind ZeroAdamW's gradient reduction, timed on their own: why gloo reduce-scatters with an
all-to-all.

    python bench/investigations/bench_collectives.py        # CPU: 2 gloo processes, the main job's 3.3M params
    python bench/investigations/bench_collectives.py --world-size 3 --numel 1000000

Every rank holds a buffer of --numel fp32 elements (default: the main job's GPT, padded to whole buckets), and
each contender reduces it over the ranks, as one collective and cut into --buckets pieces, in the same
launch, interleaved round-robin (a barrier before every repetition; median of the slowest rank's times):

  all_reduce               dist.all_reduce: what DDP does
  reduce_scatter_tensor    dist.reduce_scatter_tensor (the flat-tensor reduce-scatter NCCL runs natively)
  reduce_scatter_list      dist.reduce_scatter with a list of N input slices
  all_to_all + sum         dist.all_to_all_single into a receive buffer, then the N received slices summed in
                           rank order: what zero_ext.comm.Communicator does on gloo (fp32 and bf16 input)
  all_gather (bf16)        dist.all_gather_into_tensor in place, of half the bytes: ZeroAdamW's param gather
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEFAULT_NUMEL = 3_323_392  # the main job's GPT (bench/gpt_model.py defaults): every bucket padding is zero at N = 2


def _contenders(rank: int, world: int, numel: int, buckets: int) -> dict:
    x = torch.randn(numel)
    x16 = x.bfloat16()
    received, received16 = torch.empty(numel), torch.empty(numel, dtype=torch.bfloat16)
    out = torch.empty(numel // world)
    params = torch.zeros(numel, dtype=torch.bfloat16)
    size = numel // buckets

    def pieces(fn):
        def run():
            for b in range(buckets):
                fn(slice(b * size, (b + 1) * size))

        return run

    def all_reduce(s):
        dist.all_reduce(x[s], async_op=True).wait()

    def reduce_scatter_tensor(s):
        dist.reduce_scatter_tensor(out[: size // world], x[s], async_op=True).wait()

    def reduce_scatter_list(s):
        dist.reduce_scatter(out[: size // world], list(x[s].chunk(world)), async_op=True).wait()

    def all_to_all_sum(source, recv):
        def run(s):
            r = recv[:size]
            dist.all_to_all_single(r, source[s], async_op=True).wait()
            slices = r.view(world, -1).unbind(0)
            acc = out[: size // world]
            acc.copy_(slices[0])
            for t in slices[1:]:
                acc.add_(t)

        return run

    def all_gather(s):
        mine = params[s][rank * (size // world) : (rank + 1) * (size // world)]
        dist.all_gather_into_tensor(params[s], mine, async_op=True).wait()

    fns = {
        "all_reduce (fp32)": all_reduce,
        "reduce_scatter_tensor (fp32)": reduce_scatter_tensor,
        "reduce_scatter_list (fp32)": reduce_scatter_list,
        "all_to_all + sum (fp32)": all_to_all_sum(x, received),
        "all_to_all + sum (bf16 in, fp32 sum)": all_to_all_sum(x16, received16),
        "all_gather in place (bf16)": all_gather,
    }
    return {name: pieces(fn) for name, fn in fns.items()}


def _bench(rank: int, world: int, device, numel: int, bucket_counts: list, reps: int, warmup: int) -> dict:
    torch.manual_seed(rank)
    fns = {}
    for buckets in bucket_counts:
        for name, fn in _contenders(rank, world, numel, buckets).items():
            fns[f"{name}|{buckets}"] = lambda fn=fn: harness.timed(fn)
    times = harness.round_robin(fns, warmup, reps, before=dist.barrier)
    out = {}
    for key, t in times.items():
        t = torch.tensor(t, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, repetition by repetition
        out[key] = t.tolist()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--numel", type=int, default=DEFAULT_NUMEL, help="fp32 elements per rank")
    p.add_argument("--buckets", default="1,4,8", help="bucket counts to cut the buffer into")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default="collectives_cpu")
    args = p.parse_args(argv)
    bucket_counts = [int(b) for b in args.buckets.split(",")]
    granule = args.world_size * max(bucket_counts) * 64
    numel = -(-args.numel // granule) * granule  # every bucket splits evenly over the ranks
    meta = harness.meta(torch.device("cpu"))
    res = harness.launch(_bench, args.world_size, "cpu", numel, bucket_counts, args.reps, args.warmup)

    stats = {key: harness.summary(times) for key, times in res.items()}
    rows, payload = [], {}
    for key, times in res.items():
        name, buckets = key.rsplit("|", 1)
        s, base = stats[key], stats[f"all_reduce (fp32)|{buckets}"]
        rows.append([name, buckets, f"{s['median_s'] * 1e3:.2f}", f"{s['q1_s'] * 1e3:.2f}-{s['q3_s'] * 1e3:.2f}",
                     f"{s['median_s'] / base['median_s']:.2f}x"])  # fmt: skip
        payload[key] = {"times_s": times, "median_s": s["median_s"]}
    headers = ["collective", "buckets", "median ms", "IQR ms", "vs all_reduce (same buckets)"]
    body = (
        f"{args.world_size} gloo ranks, 1 thread each; {numel:,} fp32 elements per rank ({numel * 4 / 2**20:.2f} MiB), "
        f"cut into {args.buckets} buckets; {args.reps} repetitions after {args.warmup} warm-up, interleaved; "
        "times are the slowest rank's.\n\n"
        + harness.markdown_table(headers, rows)
        + "\n\n- all_to_all + sum sends the (N-1)/N of the buffer a ring reduce-scatter sends and sums locally in"
        " rank order (zero_ext.comm); with bf16 input it sends half the bytes and sums in fp32.\n"
    )
    print(harness.text_table(headers, rows))
    cfg = {"world_size": args.world_size, "numel": numel, "buckets": bucket_counts, "reps": args.reps}
    paths = harness.write_results(args.name, meta, {"config": cfg, "runs": payload}, body, args.out_dir)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
