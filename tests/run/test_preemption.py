import signal
import subprocess
import sys
import textwrap


def run_child(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import os, signal, time
        from atma_titan.run.preemption import StopRequest
        stop = StopRequest(abort_after_s=0.2).install()
        {body}
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_first_signal_requests_a_stop():
    proc = run_child("os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05); print(stop.requested, stop.received)")
    assert proc.returncode == 0 and proc.stdout.strip() == "True SIGUSR1"
    assert "finishing this step" in proc.stderr


def test_duplicate_signal_within_the_grace_period_is_ignored():
    proc = run_child(
        "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05); print('alive')"
    )
    assert proc.returncode == 0 and "alive" in proc.stdout


def test_second_signal_later_aborts_at_once():
    proc = run_child(
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.3); os.kill(os.getpid(), signal.SIGTERM);"
        " time.sleep(5); print('alive')"
    )
    assert proc.returncode == 128 + signal.SIGTERM and "alive" not in proc.stdout
    assert "aborting now" in proc.stderr
