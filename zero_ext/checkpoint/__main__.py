"""``python -m zero_ext.checkpoint consolidate PATH OUT``: a sharded checkpoint (zero_ext's, or a DCP one: a directory
with ``.metadata``) to safetensors, no GPU needed."""

from __future__ import annotations

import os

from .consolidate import consolidate
from .dcp_export import export_dcp, is_dcp_checkpoint
from .format import CheckpointError


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zero_ext.checkpoint", description="zero_ext checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write OUT/optimizer.safetensors and OUT/model.safetensors")
    c.add_argument("path")
    c.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if is_dcp_checkpoint(args.path):  # torch.distributed.checkpoint's (zero_ext's get_state_dict, or FSDP2's)
            export_dcp(args.path, args.out)
        else:
            consolidate(args.path, args.out)
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {os.path.join(args.out, 'optimizer.safetensors')} and {os.path.join(args.out, 'model.safetensors')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
