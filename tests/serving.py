"""A `localchat serve` subprocess for the tests that drive it: on 127.0.0.1, a free port
(read from its first line on stderr), its later stderr lines kept (one per request)."""
import http.client
import json
import os
import re
import subprocess
import sys
import threading

from waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    def __init__(self, model, *flags, env: dict | None = None):
        env = dict(os.environ, PYTHONPATH=ROOT, LOCALCHAT_API_KEY="", **(env or {}))
        env.pop("LOCALCHAT_API_KEY")
        self.proc = subprocess.Popen([sys.executable, "-m", "localchat", "serve", "--model", str(model), "--port", "0",
                                      "--drafter", "none", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        first = self.proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", first)
        assert m, first + self.proc.stderr.read()
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self.get("/health")[0] == 200, 120)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def request(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, json.loads(data) if data else None, {k.lower(): v for k, v in r.getheaders()}

    def get(self, path):
        try:
            return self.request("GET", path)[:2]
        except OSError:
            return 0, None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
