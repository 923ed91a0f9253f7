"""The chat UI's engine thread: one daemon thread, jobs in order, closing drops the queue."""
import threading

from localchat.tui.engine_thread import EngineThread


def test_jobs_run_in_order_on_one_daemon_thread_and_close_drops_the_queue():
    """Every job runs on the same thread (one OpenMP team for the engine), a daemon (the
    interpreter does not wait for it at exit), in submission order; after close() the
    running job finishes, queued ones are dropped and new ones refused."""
    runner = EngineThread()
    seen, release, started = [], threading.Event(), threading.Event()

    def job(i):
        return lambda: seen.append((i, threading.current_thread()))

    def blocking():
        started.set()
        release.wait(10)
        seen.append(("blocking", threading.current_thread()))

    for i in range(3):
        assert runner.submit(job(i))
    assert runner.submit(blocking)
    assert started.wait(10)
    assert runner.submit(job("dropped"))
    runner.close()
    assert not runner.submit(job("refused"))
    release.set()
    runner._thread.join(10)
    assert [name for name, _ in seen] == [0, 1, 2, "blocking"]
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threads.pop().daemon
