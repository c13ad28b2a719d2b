"""Which zero_ext files one training step visits: a stage-2 backward (gradient hooks -> reduce-scatter -> grad
shard) and ``step()`` (update -> all-gather), on rank 0 of 2 gloo ranks, bf16 parameters.

    python bench/investigations/grad_path_files.py [--stage 2]

A profile hook records every Python call whose code lies in zero_ext (the Triton kernels' package included) and
counts an *entry* whenever the caller's file differs: how many files a step touches, in the order control first
reaches them, and how often control crosses into each; then the same, cut at each entry from outside zero_ext (one
gradient hook, the end-of-backward callback, ``step()``). The layering goal (docs/architecture.md) is a gradient that
crosses each layer once; this counts how far the code is from it. Results: results/grad_path_files.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
from harness import markdown_table, meta, write_results  # noqa: E402


def _files(rank: int, world: int, port: int, stage: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zero_ext

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    opt = zero_ext.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, module=model if stage == 3 else None)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for _ in range(2):  # warm: buffers sized, lazily made objects made
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    package = os.path.realpath(os.path.dirname(zero_ext.__file__))
    kernels = os.path.realpath(os.path.dirname(zero_ext.kernels.__file__))

    def where(filename: str):
        f = os.path.realpath(filename)
        if f.startswith(kernels + os.sep):
            return "kernels/" + os.path.relpath(f, kernels)
        return os.path.relpath(f, package) if f.startswith(package + os.sep) else None

    entries, order = collections.Counter(), []
    layer_entries = collections.Counter()  # control entering a layer (folder) from another layer or from outside
    # One segment per entry from outside zero_ext (a gradient hook, the end-of-backward callback, step()): the files
    # it visits in order, each file's entries and each layer's, and the collectives it starts
    segments: list[dict] = []
    stack: list[str] = []  # the files of the zero_ext frames on the stack: a call on an empty stack starts a segment

    def zero_ext_caller(frame):
        """The zero_ext file that called ``frame``, looking through a few frames of torch's own wrappers (a hook
        decorated with ``torch.compiler.disable`` is called by dynamo's wrapper, not by the engine's hook); None
        when the call came from outside zero_ext."""
        back = frame.f_back
        for _ in range(4):
            if back is None:
                return None
            f = where(back.f_code.co_filename)
            if f is not None:
                return f
            back = back.f_back
        return None

    def layer(f):
        return None if f is None else f.split("/")[0].removesuffix(".py")

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        here = where(frame.f_code.co_filename)
        if here is None:
            return
        if event == "return":
            stack.pop()
            return
        if not stack:
            segments.append({"entry": f"{here}:{frame.f_code.co_name}", "files": collections.Counter(),
                             "order": [], "layers": collections.Counter(), "collectives": [],
                             "called_back": collections.Counter()})  # fmt: skip
        seg = segments[-1]
        if frame.f_code.co_name.startswith("start_") and here.startswith("comm/"):
            seg["collectives"].append(frame.f_code.co_name)
        caller = zero_ext_caller(frame)
        if caller != here and here in stack:  # control came back into a file that called down: a callback
            seg["called_back"][here] += 1
        stack.append(here)
        if caller != here:
            entries[here] += 1
            seg["files"][here] += 1
            if here not in order:
                order.append(here)
            if here not in seg["order"]:
                seg["order"].append(here)
            if layer(caller) != layer(here):
                layer_entries[layer(here)] += 1
                seg["layers"][layer(here)] += 1

    loss = model(x).float().pow(2).mean()
    sys.setprofile(profile)
    threading.setprofile(profile)
    loss.backward()
    opt.step()
    sys.setprofile(None)
    threading.setprofile(None)
    if rank == 0:
        queue.put((order, dict(entries), dict(layer_entries), segments))
    dist.barrier()
    os._exit(0)  # pytorch#190489: gloo can abort at interpreter exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    info = meta(torch.device("cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_files, args=(r, 2, port, args.stage, queue)) for r in range(2)]
    for p in procs:
        p.start()
    order, entries, layer_entries, segments = queue.get(timeout=300)
    for p in procs:
        p.join()
    layers = list(dict.fromkeys(f.split("/")[0].removesuffix(".py") for f in order))
    rows = [(i + 1, f"`{f}`", entries[f]) for i, f in enumerate(order)]
    body = (
        f"One stage-{args.stage} backward + `step()` on rank 0 of 2 gloo ranks visits **{len(order)} zero_ext files** "
        f"in {len(layers)} layers ({', '.join(layers)}), with {sum(entries.values())} entries from another file.\n\n"
        + markdown_table(["first reached", "file", "entries"], rows)
        + "\n\nControl entering each layer (a folder, or a top-level module) from another layer or from outside "
        "zero_ext (autograd's hooks, the caller of `step()`):\n\n"
        + markdown_table(["layer", "entries"], sorted(layer_entries.items(), key=lambda kv: -kv[1]))
    )
    seg_rows = []
    for i, seg in enumerate(segments):
        files = seg["files"]
        seg_rows.append((
            i + 1, f"`{seg['entry']}`", len(files), sum(files.values()),
            max(files.values(), default=0), max(seg["layers"].values(), default=0),
            ", ".join(f"{k} {v}" for k, v in seg["layers"].items()), ", ".join(seg["collectives"]) or "-",
        ))  # fmt: skip
    body += (
        "\n\nThe same run cut at each entry from outside zero_ext (a gradient hook, the end-of-backward callback, "
        "`step()`): the files each visits, their entries, the most entries of one file and of one layer, the "
        "entries by layer, and the collectives it starts:\n\n"
        + markdown_table(
            ["#", "entered at", "files", "file entries", "most of one file", "most of one layer", "layers", "starts"],
            seg_rows,
        )
    )
    launching = [seg for seg in segments if "start_reduce_scatter" in seg["collectives"]]
    gathering = [seg for seg in segments if "start_all_gather" in seg["collectives"]]
    if launching and gathering:
        path = list(dict.fromkeys(launching[0]["order"] + gathering[0]["order"]))
        body += (
            f"\n\nFrom the hook of the gradient that completes the bucket (reduce-scatter) to `step()`'s all-gather: "
            f"**{len(path)} files** ({len(launching[0]['order'])} in the hook, {len(gathering[0]['order'])} in "
            f"`step()`): " + ", ".join(f"`{f}`" for f in path) + "."
        )
    hooks = [seg for seg in segments if seg["entry"].startswith("engine/weak_hooks.py")]
    held = [seg for seg in hooks if "start_reduce_scatter" not in seg["collectives"]]
    steps = [seg for seg in segments if seg["entry"].endswith(":step")]
    cuts = {
        "held_gradient_files": max((len(seg["files"]) for seg in held), default=0),
        "launching_hook_files": len(launching[0]["files"]) if launching else 0,
        "launching_hook_files_entered_twice": sorted(f for f, n in launching[0]["files"].items() if n > 1)
        if launching
        else [],
        "launching_hook_files_called_back": sorted(launching[0]["called_back"]) if launching else [],
        "step_files": len(steps[0]["files"]) if steps else 0,
        "backward_and_step_files": len(order),
        "files_called_back": sorted({f for seg in segments for f in seg["called_back"]}),
    }
    body += (
        "\n\nThe cuts the layering targets name (issue 47: a held gradient <= 3 files; the hook that launches a bucket "
        "<= 10 files, none entered twice; one backward + `step()` <= 18 files). *Entered twice*: a file control "
        "enters more than once in the cut (from another file, as counted above, e.g. the owner calling two verbs of "
        "one object); *called back*: a file entered again while one of its own calls is still running (control "
        "going back up, the ping-pong the issue names):\n\n"
        + markdown_table(
            ["cut", "value"],
            [
                ("a held gradient (a hook that launches nothing): most files", cuts["held_gradient_files"]),
                ("the hook that launches a bucket: files", cuts["launching_hook_files"]),
                (
                    "... files entered twice",
                    ", ".join(f"`{f}`" for f in cuts["launching_hook_files_entered_twice"]) or "none",
                ),
                (
                    "... files called back",
                    ", ".join(f"`{f}`" for f in cuts["launching_hook_files_called_back"]) or "none",
                ),
                ("`step()`: files", cuts["step_files"]),
                ("one backward + `step()`: files", cuts["backward_and_step_files"]),
                (
                    "files called back anywhere in the run",
                    ", ".join(f"`{f}`" for f in cuts["files_called_back"]) or "none",
                ),
            ],
        )
    )
    name = "grad_path_files" + ("" if args.stage == 2 else f"_stage{args.stage}")
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    for path in write_results(
        name,
        info,
        {
            "stage": args.stage,
            "order": order,
            "entries": entries,
            "layer_entries": layer_entries,
            "segments": segments,
            "cuts": cuts,
        },  # fmt: skip
        body,
        **kw,
    ):
        print(path)
    print(body)


if __name__ == "__main__":
    main()
