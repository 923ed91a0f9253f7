"""Downloads against a local server that speaks the hub's protocol (tests/hub_server.py):
huggingface_hub's own client, unchanged, through `localchat models pull` and a one-shot as
a user runs them, in subprocesses with HF_ENDPOINT pointing at the server.

Resume after SIGKILL, a corrupt body refetched or refused by its hash, 500s retried with
backoff, a stall resumed, a full disk named in one line, one progress line for the whole
model, and a cached model used in place."""
import os
import signal
import subprocess
import sys
import time

import pytest

from hub_server import Hub, HubServer
from tiny import build_model

REPO = "tiny-org/tiny-llama"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("hub-model"), "llama", tokenizer=tokenizer, seed=3, hidden=128)


@pytest.fixture
def server(folder):
    hub = Hub()
    hub.add_folder(REPO, folder)
    with HubServer(hub) as srv:
        yield srv


def env_for(srv, tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=srv.endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_DOWNLOAD_TIMEOUT="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def pull(env, repo=REPO, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "localchat", "models", "pull", repo], env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def blobs(tmp_path):
    folder = tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--")) / "blobs"
    return list(folder.glob("*")) if folder.is_dir() else []


def one_line_error(proc):
    """The error line: after the progress lines, one line and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("downloading ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_a_model_is_fetched_whole_with_one_progress_line_and_then_used_in_place(server, folder, tmp_path):
    hub, env = server.hub, env_for(server, tmp_path)
    proc = pull(env)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip().split(": ", 1)[1]
    for f in hub.repos[REPO]:
        assert (open(os.path.join(path, f.name), "rb").read() == f.data), f.name
        assert hub.sent[f.name] == len(f.data), f.name            # each byte sent once
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(f"downloading {REPO}: ") for ln in lines), proc.stderr
    total = sum(len(f.data) for f in hub.repos[REPO])
    assert "100%" in lines[-1] and len(lines) <= 12                # one figure for the model, in tenths
    sent = dict(hub.sent)
    again = pull(env)                                              # all cached: nothing fetched again
    assert again.returncode == 0 and hub.sent == sent and again.stderr.strip() == "", again.stderr
    one = subprocess.run([sys.executable, "-m", "localchat", "--model", REPO, "--no-log", "--max-tokens", "4",
                          "hello"], env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr  # the one-shot answers from the cache
    assert hub.sent == sent
    assert total > 0


def test_a_download_killed_with_sigkill_resumes_where_it_stopped(server, tmp_path):
    hub, env = server.hub, env_for(server, tmp_path)
    size = len(hub.file(REPO, WEIGHTS).data)
    hub.rate = size / 4                                # about 4 s for the weights: time to kill it mid-file
    child = subprocess.Popen([sys.executable, "-m", "localchat", "models", "pull", REPO], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 120
        while hub.sent.get(WEIGHTS, 0) < size // 3 and time.monotonic() < end and child.poll() is None:
            time.sleep(0.02)
        assert child.poll() is None, "the download ended before it could be killed"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    first, end = -1, time.monotonic() + 30
    while first != hub.sent[WEIGHTS] and time.monotonic() < end:   # the server notices the dead socket
        first = hub.sent[WEIGHTS]
        time.sleep(0.5)
    assert first < size
    partial = [b for b in blobs(tmp_path) if b.name.endswith(".incomplete")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size <= first
    kept = partial[0].stat().st_size
    hub.rate = None
    proc = pull(env)
    assert proc.returncode == 0, proc.stderr
    second = hub.sent[WEIGHTS] - first
    assert second == size - kept                       # only what the disk lacked was asked for
    resent = first + second - size
    assert resent < size // 4, (first, second, size)   # what was in flight when it died, no more
    print(f"\nweights {size:,} bytes; sent before the kill {first:,}, kept {kept:,}; after {second:,}; "
          f"re-sent {resent:,} ({resent / size:.1%})")


def test_a_corrupt_body_is_fetched_again_and_a_file_that_stays_corrupt_is_refused(server, tmp_path):
    hub = server.hub
    hub.corrupt[WEIGHTS] = 1
    proc = pull(env_for(server, tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    assert hub.gets[WEIGHTS] == 2                      # the corrupt copy was caught by its sha256
    hub.corrupt[WEIGHTS] = 10
    hub.gets.clear()
    err = one_line_error(pull(env_for(server, tmp_path / "b")))
    assert WEIGHTS in err and "sha256" in err and "after two downloads" in err
    assert hub.gets[WEIGHTS] == 2
    assert not [b for b in blobs(tmp_path / "b") if b.stat().st_size == len(hub.file(REPO, WEIGHTS).data)]


def test_server_errors_are_retried_with_backoff_then_named_in_one_line(server, tmp_path):
    hub = server.hub
    hub.fail[WEIGHTS] = 2
    t0 = time.monotonic()
    proc = pull(env_for(server, tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    assert hub.gets[WEIGHTS] == 3
    assert time.monotonic() - t0 >= 3.0                # waited 1 s, then 2 s: backoff, not a tight loop
    hub.fail[WEIGHTS] = 100
    err = one_line_error(pull(env_for(server, tmp_path / "b")))
    assert "failed 4 times (HTTP 500)" in err and "resumes" in err


def test_a_stalled_body_times_out_and_resumes(server, tmp_path):
    hub = server.hub
    hub.stall[WEIGHTS] = 3.0                           # past HF_HUB_DOWNLOAD_TIMEOUT=1
    proc = pull(env_for(server, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert hub.gets[WEIGHTS] >= 2


def test_a_full_disk_is_one_line_naming_the_cache_and_what_moves_it(server, tmp_path):
    import resource
    size = len(server.hub.file(REPO, WEIGHTS).data)

    def small_disk():                                  # writes past size/2 fail with EFBIG, as a full disk would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
    err = one_line_error(pull(env_for(server, tmp_path), preexec_fn=small_disk))
    assert "no space left in" in err and str(tmp_path / "hf") in err and "HF_HUB_CACHE" in err
    assert "kept there" in err


def test_offline_a_cached_model_is_used_and_a_missing_one_is_one_line(server, tmp_path):
    env = env_for(server, tmp_path)
    assert pull(env).returncode == 0
    sent = dict(server.hub.sent)
    offline = dict(env, HF_HUB_OFFLINE="1")
    proc = pull(offline)
    assert proc.returncode == 0 and server.hub.sent == sent, proc.stderr
    err = one_line_error(pull(offline, repo="tiny-org/not-downloaded"))
    assert "tiny-org/not-downloaded" in err and "offline" in err.lower()


def test_a_repo_the_hub_does_not_have_is_one_line(server, tmp_path):
    err = one_line_error(pull(env_for(server, tmp_path), repo="tiny-org/nothing-here"))
    assert "tiny-org/nothing-here" in err and "no such model" in err


def test_the_chat_ui_path_hears_the_download_as_loading_progress(server, tmp_path):
    """What the TUI's loader calls (common.open_engine with its progress callback), in a
    process of its own so HF_ENDPOINT is read as a user's would be."""
    code = ("import sys; from localchat import common, config\n"
            "seen = []\n"
            "eng = common.open_engine(config.Settings(model=sys.argv[1], drafter='none'),\n"
            "                         progress=lambda what, done, total: seen.append((what, done, total)))\n"
            "got = [s for s in seen if s[0] == 'downloaded']\n"
            "print(len(got), got[-1][1], got[-1][2], eng.describe()['profile'])\n")
    proc = subprocess.run([sys.executable, "-c", code, REPO], env=env_for(server, tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    n, done, total, profile = proc.stdout.split()
    size = sum(len(f.data) for f in server.hub.repos[REPO])
    assert int(n) >= 2 and int(done) == int(total) == size
    assert proc.stderr.count("downloading ") == 0               # no stderr bar under the UI
