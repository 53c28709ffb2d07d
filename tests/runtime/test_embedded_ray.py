"""The embedded Ray a run starts: its processes get ``EMBEDDED_RAY_ENV`` (no task events, no Ray
metrics, workers at the driver's priority), it starts without Ray's dashboard head and autoscaler monitor, and the driver's own
environment (and Ray's classes) are left as they were."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.environment import temporarily_set
from relax.runtime.driver import launch


def test_environment_is_set_inside_the_block_and_restored_after(monkeypatch) -> None:
    monkeypatch.setenv("RELAX_TEST_KEPT", "before")
    monkeypatch.delenv("RELAX_TEST_NEW", raising=False)
    with temporarily_set({"RELAX_TEST_KEPT": "inside", "RELAX_TEST_NEW": "1"}):
        assert os.environ["RELAX_TEST_KEPT"] == "inside" and os.environ["RELAX_TEST_NEW"] == "1"
    assert os.environ["RELAX_TEST_KEPT"] == "before" and "RELAX_TEST_NEW" not in os.environ


def test_an_embedded_ray_s_workers_run_at_the_driver_s_priority_without_task_events_or_unused_head_processes(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os
        import psutil
        import ray
        from ray._private.node import Node
        from relax.runtime.driver.launch import EMBEDDED_RAY_ENV, _init_ray
        from relax.testing import tiny_spec

        methods = (Node.start_api_server, Node.start_monitor)
        spec, _, _ = tiny_spec({str(tmp_path)!r}, "embedded")
        assert _init_ray(spec), "an embedded Ray was expected"
        try:
            seen = ray.get(ray.remote(lambda: {{k: os.environ.get(k) for k in EMBEDDED_RAY_ENV}}).remote())
            assert seen == EMBEDDED_RAY_ENV, seen
            assert not any(k in os.environ for k in EMBEDDED_RAY_ENV), "the driver's environment changed"
            # the workers run at the driver's priority, not Ray's nice 15 below it
            assert ray.get(ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)
            started = ray._private.worker._global_node.all_processes
            assert {{"gcs_server", "raylet"}} <= set(started) and not {{"dashboard", "monitor"}} & set(started), started
            lines = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
            assert not [l for l in lines if "dashboard/dashboard.py" in l or "autoscaler/_private/monitor.py" in l
                        or "_private/monitor.py" in l], lines
            assert (Node.start_api_server, Node.start_monitor) == methods, "Ray's Node was left patched"
        finally:
            ray.shutdown()
        print("checked")
    """)
    env = {k: v for k, v in os.environ.items() if k not in launch.EMBEDDED_RAY_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-2000:]


def test_a_worker_niceness_the_user_set_is_kept(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os
        import ray
        from relax.runtime.driver.launch import _init_ray
        from relax.testing import tiny_spec

        spec, _, _ = tiny_spec({str(tmp_path)!r}, "nice")
        assert _init_ray(spec), "an embedded Ray was expected"
        try:
            print("nice", ray.get(ray.remote(lambda: os.nice(0)).remote()) - os.nice(0))
        finally:
            ray.shutdown()
    """)
    env = {**os.environ, "RAY_worker_niceness": "4"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nice 4" in done.stdout.splitlines(), done.stdout


def test_an_embedded_ray_offers_gpus_only_to_a_spec_that_asks_for_them(tmp_path: Path) -> None:
    from relax.testing import tiny_spec

    cpu, _, _ = tiny_spec(tmp_path, "cpu")
    gpu, _, _ = tiny_spec(tmp_path, "gpu", "cluster.gpus_per_node=1", "roles.actor.gpus=1")
    assert launch.embedded_ray_gpus(cpu) == 0  # a CPU run leaves a GPU machine's GPUs alone
    assert launch.embedded_ray_gpus(gpu) is None  # Ray counts this machine's own


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch Ray's own processes")
def test_no_process_of_an_embedded_ray_addresses_another_machine(tmp_path: Path) -> None:
    """Ray's runtime-env agent asked for a route to 8.8.8.8 (a UDP ``connect``) to learn its node's
    address until ``EMBEDDED_RAY_ENV`` told Ray it runs on one machine. strace sees every process
    of the run; the in-process network guard sees only the test's own."""
    script = textwrap.dedent(f"""
        import ray
        from relax.runtime.driver.launch import _init_ray
        from relax.testing import tiny_spec

        spec, _, _ = tiny_spec({str(tmp_path)!r}, "routes")
        assert _init_ray(spec), "an embedded Ray was expected"
        try:
            print("answer", ray.get(ray.remote(lambda: 1).remote()))
        finally:
            ray.shutdown()
    """)
    trace = tmp_path / "trace.txt"
    env = {k: v for k, v in os.environ.items() if k not in launch.EMBEDDED_RAY_ENV}
    done = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace),
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and "answer 1" in done.stdout, done.stderr[-2000:]
    text = trace.read_text()
    addresses = set(re.findall(r'inet_addr\("([0-9.]+)"\)', text)) | set(re.findall(r'inet_pton\(AF_INET6, "([^"]+)"', text))
    assert "127.0.0.1" in addresses, "strace saw none of Ray's own loopback connections: this test checks nothing"
    assert addresses <= {"127.0.0.1", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1"}, sorted(addresses)
