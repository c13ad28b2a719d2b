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


def test_compressed_prediction_step_times():
    """At 8 x 8 on both links: the node's inter-node bytes int8 < bf16 < fp32 mesh < 1-D, differing by the replicas'
    element bytes (4 : 2 : 1 + 4/64) on the same gradient shard; every step is compute + the reduction beyond 2/3 of
    it + the all-gather, and each layout's collectives are the ones its seconds add up from."""
    rows, text = bench_hsdp_cluster.compressed_prediction()
    for tokens in (8 * 4096, 4096):
        for link in ("400 Gbit/s InfiniBand", "100 Gbit/s Ethernet"):
            by = {r["layout"]: r for r in rows if r["link"] == link and r["tokens_per_gpu"] == tokens}
            node = [by[k]["node_bytes_per_direction"] for k in ("mesh, int8 inter-node", "mesh, bf16 inter-node",
                                                                  "mesh 8 x 8", "1-D over 64")]  # fmt: skip
            assert node == sorted(node)
            fp32, bf16, int8 = node[2], node[1], node[0]
            assert (fp32 - bf16) * (4 - 1 - 4 / 64) == pytest.approx((fp32 - int8) * 2, rel=1e-12)
            for r in by.values():
                hidden = max(0.0, r["hideable_s"] - 2 / 3 * r["compute_s"])
                assert r["step_s"] == pytest.approx(r["compute_s"] + hidden + r["exposed_s"])
                assert r["hideable_s"] + r["exposed_s"] == pytest.approx(sum(c["seconds"] for c in r["collectives"]))
    compute = {r["tokens_per_gpu"]: r["compute_s"] for r in rows}
    assert compute[8 * 4096] == pytest.approx(6 * 7e9 * 8 * 4096 / (989e12 * 0.4))
    assert "| 100 Gbit/s Ethernet |" in text and "What it rests on" in text


def test_fit_link_constants_recovers_known_ones():
    import hsdp_cluster_analysis as analysis

    pts = [{"seconds": local + max(0.0, b * 8 / rate / 0.8 - 0.03), "local_s": local, "link_bytes": b, "rate_bps": rate}
           for local, b in ((0.05, 4e6), (0.08, 7e6), (0.06, 2e6)) for rate in (1e8, 1e9)]  # fmt: skip
    f = analysis.fit_link_constants(pts)
    assert f["efficiency"] == pytest.approx(0.8, rel=1e-3) and f["overlap_s"] == pytest.approx(0.03, abs=1e-3)


def test_reanalyse_committed_runs(tmp_path):
    """``--reanalyse`` of the committed stage 2 and 3 runs (copies): the measured fields stay as they were, every
    row gets gloo's link bytes within 1 % of the veth's below 1 Gbit/s shaping, and each shaped row a prediction in
    and out of sample."""
    import json
    import shutil

    names = ["hsdp_cluster_compressed", "hsdp_cluster_compressed_stage3"]
    paths = [str(shutil.copy(BENCH / "results" / f"{n}.json", tmp_path)) for n in names]
    before = [json.load(open(p)) for p in paths]
    assert bench_hsdp_cluster.main(["--reanalyse", ",".join(paths)]) == 0
    for n, old in zip(names, before):
        new = json.load(open(tmp_path / f"{n}.json"))
        assert (tmp_path / f"{n}.md").exists() and (tmp_path / f"{n}.png").exists()
        assert new["meta"]["date"] == old["meta"]["date"] and "reanalysis" in new["meta"]
        for a, b in zip(old["rows"], new["rows"]):
            assert all(a[k] == b[k] for k in ("contender", "rate", "seconds", "times", "veth_bytes_a_to_b"))
            if b["rate"] != "100mbit":  # at 100 Mbit/s tbf segments the packets: the veth counts 5 % headers
                assert b["link_bytes"] == pytest.approx(max(b["veth_bytes_a_to_b"], b["veth_bytes_b_to_a"]), rel=0.01)
        model = new["link_model"]
        assert model["rows"] == 16 and "in_sample" in model and "out_of_sample" in model
        assert all("rel_error_out" in r for r in new["rows"] if r["rate_bps"] is not None)


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
