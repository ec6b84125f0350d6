"""hydraddp's commands end as the interpreter would (``exit_codes.exit_without_teardown``), less its teardown: the
threading exit hooks first (they stop ``concurrent.futures`` pools, inductor's compile workers among them), then the
join of the non-daemon threads, then the ``atexit`` handlers. A hand-made copy that joined the threads first waited
forever on a pool that only its hook stops: a cold-cache compiled run printed its done line and never exited."""

import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.helpers.spawn import REPO, UNTRACKED, assert_no_orphans, child_env


def test_an_entry_point_ends_after_its_pools_threads_and_exit_handlers_as_python_does(tmp_path):
    """What the interpreter's exit does, in its order: a thread pool left open (its idle workers stop at the threading
    hook), a non-daemon thread still working (joined: its line is printed), then an ``atexit`` handler, which sees
    the thread done; and ``main``'s code becomes the exit status."""
    script = textwrap.dedent("""
        import atexit, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from hydraddp.exit_codes import exit_without_teardown

        pools = []

        def main():
            pools.append(ThreadPoolExecutor(2))  # held and never shut down, as inductor keeps its compile pool
            pools[0].submit(time.sleep, 0.1).result()
            def work():
                time.sleep(0.5)
                print("thread done", flush=True)
            threading.Thread(target=work).start()
            atexit.register(lambda: print("atexit ran", flush=True))
            return 7

        exit_without_teardown(main)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=child_env(uuid.uuid4().hex),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.splitlines()) == (7, ["thread done", "atexit ran"]), done.stderr


@pytest.mark.slow
def test_a_cold_cache_compiled_one_process_run_exits_after_its_done_line(tmp_path):
    """A newcomer's first ``backend=none trainer.compile=true`` run (inductor's cache empty, so its compile pool
    starts) exits 0 once it printed its done line. The bound is a hang guard, not a measure of speed."""
    token = uuid.uuid4().hex
    env = child_env(token, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")})
    proc = subprocess.Popen([sys.executable, "-m", "hydraddp", "backend=none", "trainer.compile=true",
                             "trainer.max_steps=4", UNTRACKED], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("hydraddp: done."):
                break
        assert lines and lines[-1].startswith("hydraddp: done."), "".join(lines[-40:])
        done_at = time.monotonic()
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the run printed its done line and did not exit within 60 s: it hangs at exit")
        print(f"exited {time.monotonic() - done_at:.2f} s after its done line")
        assert proc.returncode == 0, "".join(lines[-40:]) + rest
    finally:
        proc.kill()
    assert (tmp_path / "inductor-cache").exists()  # the cache was cold and compiled into, as for a newcomer
    assert_no_orphans(token)
