"""Processes forked from one that has imported torch already, for tests that run Python in a subprocess.

A fresh `python` spends about 2.5 s importing torch and 0.8 s more at exit in the interpreter's
teardown of it; tests that run scripts pay that at every run. A `ForkServer` is one process per test
worker (per kind: the Triton interpreter's, the scripts') that has run its preload once and forks a
child for each request: the child starts where a fresh process would be after those imports, runs the
request's code (in the request's working directory and environment, if it names them), writes its
output to files and exits with the code that process would have. Nothing has run a torch operation
in the server before a fork (no thread pools to inherit).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_SERVER = """
import json, os, sys, traceback
GLOBALS = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(_PRELOAD, "<preload>", "exec"), GLOBALS)
exec(compile(_WARM, "<warm>", "exec"), {})
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdin, sys.stdout, sys.stderr = (open(0), open(1, "w", closefd=False), open(2, "w", closefd=False))
        code = 0
        try:
            if request["cwd"] is not None:
                os.chdir(request["cwd"])
            if request["env"] is not None:
                os.environ.clear()
                os.environ.update(request["env"])
            exec(compile(request["code"], "<string>", "exec"), GLOBALS)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        if request["atexit"]:   # what the interpreter runs at any exit, before its teardown
            import atexit
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class ForkServer:
    """A server process started at the first request: `preload` run once (its names are the children's
    globals), then `warm` (imports that give the children no names), with `env` added to this process's
    environment and the repository on its path."""

    def __init__(self, warm: str, preload: str = "", env: dict[str, str] | None = None):
        self.warm, self.preload, self.env = warm, preload, env or {}
        self._server: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            env = {**os.environ, **self.env}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
            code = f"_PRELOAD = {self.preload!r}\n_WARM = {self.warm!r}\n" + _SERVER
            self._server = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, bufsize=1)
            atexit.register(self._server.stdin.close)   # the server ends when its input does
        return self._server

    def run(self, code: str, args: list[str], timeout: float, cwd: str | Path | None = None,
            env: dict[str, str] | None = None, run_atexit: bool = False) -> subprocess.CompletedProcess:
        """Run `code` in a forked child (`args`: the command line the result reports); its stdout and
        stderr come back as text, its exit code as the return code. Past `timeout` the child is killed
        and TimeoutExpired raised, as `subprocess.run` does."""
        server = self._start()
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"code": code, "stdout": str(out), "stderr": str(err), "cwd": None if cwd is None else str(cwd),
                       "env": env, "atexit": run_atexit}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            ready, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))
            returncode = server.stdout.readline() if ready else ""
            if not returncode:
                os.kill(pid, signal.SIGKILL)
                server.stdout.readline()   # the server reaps it
                raise subprocess.TimeoutExpired(args, timeout)
            return subprocess.CompletedProcess(args, int(returncode), out.read_text(), err.read_text())


# The benchmark and checkpoint scripts' server: what they all import, nothing that runs an operation.
_SCRIPTS = ForkServer(warm="import numpy, torch\nimport moestream.engine, moestream.bench\n")


def run_script(script: str | Path, *args: str, timeout: float = 300, cwd: str | Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, script, *args], capture_output=True, text=True)`, as a forked child of
    the scripts' server: `__main__` is the script, sys.argv and sys.path[0] are what `python script` sets,
    the environment is this process's (or `env`), and atexit handlers run at its end."""
    script = str(Path(script).resolve())
    code = ("import os, runpy, sys, torch\n"
            "if os.environ.get('OMP_NUM_THREADS', '').isdigit():   # read by a fresh process's torch at its start\n"
            "    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))\n"
            f"sys.argv = {[script, *args]!r}\n"
            f"sys.path[0] = {os.path.dirname(script)!r}\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")
    return _SCRIPTS.run(code, [sys.executable, script, *args], timeout, cwd=cwd,
                        env=dict(os.environ) if env is None else env, run_atexit=True)
