"""bench/bench_hsdp_cluster.py without root: the skip path (no namespaces: it says why and exits 0), its helpers, the
8 x 8 H100 prediction it prints, and the memory table's check. The emulated cluster itself needs root and runs only
when asked (``ZERO_EXT_NETNS=1``, marked slow): CI never needs root."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_hsdp_cluster  # noqa: E402
import netns_cluster  # noqa: E402


def test_unavailable_says_why_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in netns_cluster.unavailable()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_cluster.shutil, "which", lambda tool: None)
    assert "iproute2" in netns_cluster.unavailable()


def test_skip_path_prints_why_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_hsdp_cluster, "unavailable", lambda: "network namespaces need root (test)")
    assert bench_hsdp_cluster.main(["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "need root (test)" in out and "8 nodes x 8 H100" in out
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


def test_skip_as_a_user_runs_it_without_root(tmp_path):
    # the script as a user runs it, in a process that is not root (os.geteuid says so)
    script = str(BENCH / "bench_hsdp_cluster.py")
    code = ("import os, runpy, sys; os.geteuid = lambda: 1000; "
            f"sys.argv = [{script!r}, '--out-dir', {str(tmp_path)!r}]; runpy.run_path({script!r}, run_name='__main__')")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stdout and "root" in done.stdout and not any(tmp_path.iterdir())


def test_parse_rate():
    assert netns_cluster.parse_rate("100mbit") == 1e8
    assert netns_cluster.parse_rate("10Gbit") == 1e10
    assert netns_cluster.parse_rate("none") is None


def test_h100_prediction_mesh_beats_1d():
    rows, text = bench_hsdp_cluster.h100_prediction(params_b=(7,), stages=(2, 3))
    for row in rows:
        assert row["mesh"]["seconds"] < row["mesh_replicated"]["seconds"] < row["1d"]["seconds"]
        bound = 0.5 if row["stage"] == 2 else 0.25
        assert row["mesh"]["inter_bytes"] <= bound * row["1d"]["inter_bytes"]
    assert "| 7B | 2 |" in text


def test_compressed_prediction_orders_the_layouts():
    """At 8 x 8 on both links: int8 < bf16 < fp32 mesh < 1-D, the inter-node bytes in the ratio of the replicas'
    element bytes for the gradient shard (4 : 2 : 1 + 4/64) plus the same parameter all-gather."""
    rows, text = bench_hsdp_cluster.compressed_prediction()
    for link in ("400 Gbit/s InfiniBand", "100 Gbit/s Ethernet"):
        by = {r["layout"]: r for r in rows if r["link"] == link}
        seconds = [by[k]["seconds"] for k in ("mesh, int8 inter-node", "mesh, bf16 inter-node", "mesh 8 x 8",
                                              "1-D over 64")]  # fmt: skip
        assert seconds == sorted(seconds)
        fp32, bf16 = by["mesh 8 x 8"]["inter_bytes"], by["mesh, bf16 inter-node"]["inter_bytes"]
        int8 = by["mesh, int8 inter-node"]["inter_bytes"]
        assert (fp32 - bf16) * (4 - 1 - 4 / 64) == pytest.approx((fp32 - int8) * 2, rel=1e-12)
    assert "| 100 Gbit/s Ethernet |" in text


def test_fit_recovers_a_known_line():
    pts = [{"seconds": c + 1.5 * u, "u": u, "contender": name}
           for name, c in (("a", 0.01), ("b", 0.03)) for u in (0.1, 0.2, 0.4)]  # fmt: skip
    f = bench_hsdp_cluster.fit(pts, "u")
    assert f["k"] == pytest.approx(1.5) and f["c_s"] == pytest.approx({"a": 0.01, "b": 0.03})
    assert f["max_abs_rel_error"] < 1e-9


def test_memory_table_default_below_fsdp2_hsdp(tmp_path):
    import bench_hsdp_memory

    assert bench_hsdp_memory.main(["--sizes", "7", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "hsdp_memory_8x8.md").read_text().count("PASS") == 1


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ZERO_EXT_NETNS") != "1", reason="needs root and ZERO_EXT_NETNS=1")
def test_emulated_cluster_tiny(tmp_path):
    why = netns_cluster.unavailable()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(BENCH / "bench_hsdp_cluster.py"), "--rates", "100mbit,none", "--params-m", "0.1",
           "--steps", "1", "--warmup", "1", "--compressed", "--fsdp2", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "hsdp_cluster.json").exists()
    assert "zx" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
