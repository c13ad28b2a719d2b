"""A checkpoint read is safe whatever the files hold: reads stay inside the checkpoint directory; damage (every
byte of the metadata flipped in turn, bytes of the shards flipped, files truncated or extended) gives a clear
CheckpointError, never a crash, a hang or a silently different state; and forged metadata (fields replaced by
random JSON and the checksums recomputed, as an attacker would) either is a valid checkpoint of its own or gives a
clear CheckpointError, from the reader and from a load into an optimizer, never another exception."""

from __future__ import annotations

import json
import os
import shutil
import zlib

import pytest
import torch
from distributed import run_on_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.checkpoint import Checkpoint, CheckpointError
from zero_ext.checkpoint.format import as_bytes, dtype_of

# Slow as a whole: every test reads the checkpoint a 2-rank run saves (the module fixture) and most flip or forge
# its bytes hundreds of times. The fast loop keeps test_checkpoint.py's truncated/corrupted/missing files test.
pytestmark = pytest.mark.slow

JSON_FILES = ["COMPLETE", "meta.json", "rank00000.json", "rank00001.json"]


def _save(rank, world, path):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=2, bucket_size=1500)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    checkpoint.save(path, opt)
    return True


class _Saved(tuple):
    def __repr__(self) -> str:  # hypothesis prints the fixture in a falsifying example
        return f"<checkpoint {self[0]}>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "ck"
    assert all(run_on_ranks(2, _save, str(path)))
    return _Saved((path, _read_all(path)))


def _read_all(path) -> dict[str, torch.Tensor]:
    """Everything a load could read: every kind of every parameter, assembled from the shards."""
    ck = Checkpoint(path)
    out = {}
    try:
        for e in ck.params.values():
            numel = int(torch.Size(e["shape"]).numel())
            kinds = ["master", "exp_avg", "exp_avg_sq"] + ([] if e["dtype"] == "float32" else ["param"])
            for kind in kinds:
                dtype = torch.float32 if kind != "param" else dtype_of(e["dtype"], "")
                t = torch.zeros(numel, dtype=dtype)
                raw = as_bytes(t)
                ck.execute([(r, off, n, raw[at:]) for r, off, n, at in ck.plan(e["index"], kind, 0, numel)])
                out[f"{kind}/{e['name']}"] = t
            out[f"step/{e['name']}"] = torch.tensor(ck.param_step(e))
    finally:
        ck.close()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, name, record) -> None:
    """Write a JSON file of the checkpoint and record its new checksum in COMPLETE (what a forger would do)."""
    data = json.dumps(record).encode()
    (path / name).write_bytes(data)
    if name != "COMPLETE":
        marker = json.loads((path / "COMPLETE").read_text())
        marker["crc32"][name] = zlib.crc32(data)
        (path / "COMPLETE").write_text(json.dumps(marker))


def _read_or_clear_error(path, original) -> str:
    """'same' or 'error': anything else (another exception, a different state) fails the test."""
    try:
        got = _read_all(path)
    except CheckpointError as e:
        assert str(e), "an empty error message"
        return "error"
    assert _same(got, original), "a damaged checkpoint was read as a different state"
    return "same"


# ---------------------------------------------------------------------------------------------- containment
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_reads_stay_inside_the_checkpoint(saved, tmp_path, how):
    path, original = saved
    ck = _copy(path, tmp_path / "ck")
    outside = tmp_path / "outside.bin"
    shutil.copy(ck / "rank00000.bin", outside)  # the same bytes: only containment can refuse them
    record = json.loads((ck / "rank00000.json").read_text())
    if how == "symlink":
        os.remove(ck / "rank00000.bin")
        os.symlink(outside, ck / "rank00000.bin")
    else:
        record["file"] = "../outside.bin" if how == "dotdot" else str(outside)
        _rewrite(ck, "rank00000.json", record)
    with pytest.raises(CheckpointError, match="lies outside the checkpoint directory"):
        _read_all(ck)
    with pytest.raises(CheckpointError, match="lies outside the checkpoint directory"):
        checkpoint.consolidate(ck, tmp_path / "out")


def test_a_symlink_inside_the_checkpoint_is_fine(saved, tmp_path):
    path, original = saved
    ck = _copy(path, tmp_path / "ck")
    os.rename(ck / "rank00001.bin", ck / "data1.bin")
    os.symlink("data1.bin", ck / "rank00001.bin")
    assert _same(_read_all(ck), original)


# ---------------------------------------------------------------------------------------------- byte flips
def test_every_byte_of_the_metadata_flipped(saved, tmp_path):
    path, original = saved
    ck = _copy(path, tmp_path / "ck")
    outcomes = {"error": 0, "same": 0}
    for name in JSON_FILES:
        data = (ck / name).read_bytes()
        for i in range(len(data)):
            (ck / name).write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
            outcomes[_read_or_clear_error(ck, original)] += 1
        (ck / name).write_bytes(data)
    assert outcomes["error"] > 0.99 * sum(outcomes.values()), outcomes
    assert _same(_read_all(ck), original)


def test_bytes_of_the_shards_flipped(saved, tmp_path):
    path, original = saved
    ck = _copy(path, tmp_path / "ck")
    for name in ("rank00000.bin", "rank00001.bin"):
        data = (ck / name).read_bytes()
        for i in range(0, len(data), 61):
            (ck / name).write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])
            # Section padding is checksummed too: every flip is caught by its block's crc32.
            assert _read_or_clear_error(ck, original) == "error", f"{name} byte {i}"
        (ck / name).write_bytes(data[: len(data) // 2])  # truncated
        assert _read_or_clear_error(ck, original) == "error"
        (ck / name).write_bytes(data + b"\0")  # longer than recorded
        assert _read_or_clear_error(ck, original) == "error"
        (ck / name).write_bytes(data)


# ---------------------------------------------------------------------------------------------- forged fields
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 10**18])
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["../x", "/etc/passwd", "rank00000.bin", "float32", "bfloat16", "master"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def _paths(value, prefix=()):
    """Every (path to a value) in a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _replace(doc, path, value, delete):
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_forged_fields_give_a_clear_error(saved, tmp_path_factory, data):
    path, _ = saved
    ck = _copy(path, tmp_path_factory.mktemp("forged") / "ck")
    name = data.draw(st.sampled_from(JSON_FILES), label="file")
    doc = json.loads((ck / name).read_text())
    where = data.draw(st.sampled_from(list(_paths(doc))), label="field")
    delete = bool(where) and data.draw(st.booleans(), label="delete")
    value = None if delete else data.draw(_json_values, label="value")
    _rewrite(ck, name, _replace(doc, where, value, delete))
    try:
        _read_all(ck)  # forged but well-formed: read as what it says
    except CheckpointError:
        pass
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=2, bucket_size=1500)
    try:
        checkpoint.load(ck, opt)
    except CheckpointError:
        pass
