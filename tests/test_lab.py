"""JupyterLab as a user meets it: `make lab`, a click on a problem notebook, Run All, Ctrl-C.

The tests start the real `make lab` (headless: `--no-browser` on 127.0.0.1, a free port, the random
token Jupyter generates and prints). Jupyter's config, data, runtime and workspace directories and
IPython's profile live in a temporary directory, so neither the developer's home directory nor
their own Jupyter configuration takes part; the environment's own configuration does (the jupytext
server extension, the python3 kernel, and the Lab settings `make env` installs from
jupyter/lab-overrides.json5). Checked:

* the REST API serves every problem notebook as type `notebook`, and the installed Lab settings
  (jupytext notebook as the default viewer of .py files, no news toast) are in effect;
* a kernel started through the server runs one notebook's cells in quick mode, as "Run All" does,
  and its outputs are what Lab draws: a figure (PNG), a table (markdown) and a progress-bar widget;
* headless Chromium (Debian's `chromium`; `make browserdeps` installs it) loads the Lab page of one
  notebook, the route a click in the file browser takes (the default viewer of the file type), and
  its DOM holds the notebook's cells (`jp-Cell`), no file editor and no news toast;
* Ctrl-C (SIGINT to `make lab`'s process group, stdin a terminal) stops the server and its kernels
  within seconds, without Jupyter's "Shut down this server?" prompt;
* saving a notebook from Lab (the jupytext contents manager that serves it) rewrites the `.py`
  byte-identical when nothing was edited, and the paired `.ipynb` it writes is git-ignored.

Every server is stopped in a finalizer, also when a test fails; processes left behind (kernels,
browser helpers) are found by the temporary directory in their command line and killed.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("[0-9]*_*.py"))
RUN_NOTEBOOK = "06_pytorch_attention.py"  # quick mode: a tqdm sweep, a table and a figure, ~5 s
BROWSER_NOTEBOOK = "03_mixed_precision_accumulation.py"
# `make lab`, headless on loopback with a port the OS picks; -o: never rebuild the environment here
# Checkpoints (written on every Lab save) go to the test's temp dir, not notebooks/.ipynb_checkpoints.
MAKE_LAB = ["make", "--no-print-directory", "-o", ".venv/.installed-stamp", "lab"]
LAB_ARGS = "LAB_ARGS=--no-browser --ip=127.0.0.1 --port=0 --FileCheckpoints.checkpoint_dir={checkpoints}"
URL_RE = re.compile(r"http://127\.0\.0\.1:(\d+)/lab\?token=([0-9a-f]+)")
NEWS_TOAST = "official Jupyter news"
START_TIMEOUT_S = 90
CELL_TIMEOUT_S = 120

pytestmark = [pytest.mark.xdist_group("jupyterlab"), pytest.mark.timeout(300)]


# --------------------------------------------------------------------------------------------------
# `make lab`, started and stopped like a user does
# --------------------------------------------------------------------------------------------------


@dataclass
class Lab:
    proc: subprocess.Popen
    tmp: Path
    log: Path
    port: int = 0
    token: str = ""
    tty: list[int] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def api(self, path: str, method: str = "GET", body: dict | None = None) -> dict | str:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 20
        while True:  # a loaded machine may print the URL a moment before the socket accepts
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    text = r.read().decode()
                break
            except urllib.error.URLError as exc:
                refused = isinstance(exc.reason, ConnectionRefusedError)
                if not refused or time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"{method} {path} failed: {exc}\n{self.output()[-2000:]}") from exc
                time.sleep(0.5)
        return json.loads(text) if r.headers.get_content_type() == "application/json" else text


def _isolated_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),  # a fresh layout: nothing restored
        IPYTHONDIR=str(tmp / "ipython"),
        npm_config_cache=str(tmp / "npm"),  # jupyter-lsp runs `npm prefix -g`, which logs there
        CS336_RESULTS_DIR=str(tmp / "results"),  # quick runs of the kernels write here
    )
    return env


def start_make_lab(tmp: Path) -> Lab:
    """`make lab` with a terminal as stdin (as typed by a user); returns once it printed its URL."""
    tmp.mkdir(parents=True, exist_ok=True)
    master, slave = pty.openpty()
    log = tmp / "make-lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*MAKE_LAB, LAB_ARGS.format(checkpoints=tmp / "checkpoints")],
            cwd=REPO,
            stdin=slave,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_isolated_env(tmp),
            start_new_session=True,  # its own process group, which Ctrl-C signals
        )
    lab = Lab(proc, tmp, log, tty=[master, slave])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        m = URL_RE.search(lab.output())
        if m:
            lab.port, lab.token = int(m.group(1)), m.group(2)
            return lab
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_lab(lab)
    raise AssertionError(
        f"`make lab` printed no http://127.0.0.1:PORT/lab?token=... URL:\n{lab.output()[-3000:]}"
    )


def processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (a temporary directory only these tests use)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def ctrl_c(lab: Lab, timeout: float = 30) -> int | None:
    """SIGINT to the process group, as a terminal's Ctrl-C; the exit status, or None if still running."""
    try:
        os.killpg(lab.proc.pid, signal.SIGINT)
        return lab.proc.wait(timeout=timeout)
    except ProcessLookupError:
        return lab.proc.wait()
    except subprocess.TimeoutExpired:
        return None


def kill_left_over(proc: subprocess.Popen, marker: Path) -> None:
    """SIGKILL `proc`'s process group if it still runs, then every process naming `marker`."""
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for pid in processes_mentioning(str(marker)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_lab(lab: Lab) -> None:
    """Always leaves nothing running: Ctrl-C, then SIGKILL (also for kernels in sessions of their own)."""
    if lab.proc.poll() is None:
        ctrl_c(lab, timeout=20)
    kill_left_over(lab.proc, lab.tmp)
    for fd in lab.tty:
        os.close(fd)
    lab.tty.clear()


def _home_jupyter_state() -> dict[str, int]:
    root = Path.home() / ".jupyter"
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home_before = _home_jupyter_state()
    notebooks_before = sorted(p.name for p in NB_DIR.iterdir())
    server = start_make_lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        stop_lab(server)
    assert sorted(p.name for p in NB_DIR.iterdir()) == notebooks_before, "Lab left files in notebooks/"
    assert _home_jupyter_state() == home_before, "the Lab tests changed ~/.jupyter"


# --------------------------------------------------------------------------------------------------
# REST API: contents and settings
# --------------------------------------------------------------------------------------------------


def test_every_problem_notebook_is_served_as_a_notebook(lab):
    listing = {item["name"]: item["type"] for item in lab.api("/api/contents/")["content"]}
    assert NOTEBOOKS and {n: listing.get(n) for n in NOTEBOOKS} == dict.fromkeys(NOTEBOOKS, "notebook")
    for name in NOTEBOOKS:
        model = lab.api(f"/api/contents/{name}")
        assert model["type"] == "notebook" and model["format"] == "json", name
        assert len(model["content"]["cells"]) == len(jupytext.read(NB_DIR / name).cells), name


def test_lab_settings_of_the_environment_are_in_effect(lab):
    def default(plugin: str, key: str):
        return lab.api(f"/lab/api/settings/{plugin}")["schema"]["properties"][key]["default"]

    assert default("@jupyterlab/docmanager-extension:plugin", "defaultViewers") == {
        "python": "Jupytext Notebook"
    }
    assert default("@jupyterlab/apputils-extension:notification", "fetchNews") == "false"
    page = lab.api("/lab")
    config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
    extensions = {e["name"] for e in json.loads(config.group(1))["federated_extensions"]}
    # the jupytext viewer, and the widget manager that draws tqdm's notebook progress bars
    assert {"jupyterlab-jupytext", "@jupyter-widgets/jupyterlab-manager"} <= extensions


# --------------------------------------------------------------------------------------------------
# A kernel started through the server runs a notebook in quick mode
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def kernel_channel(lab: Lab, kernel_id: str):
    """The kernel's websocket through the server, as Lab opens it."""
    import websocket

    ws = websocket.create_connection(
        f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
        header=[f"Authorization: token {lab.token}"],
        timeout=CELL_TIMEOUT_S,
    )
    try:
        yield ws
    finally:
        ws.close()


def _execute(ws, code: str) -> tuple[dict, list[dict]]:
    """One execute_request over the kernel's websocket (the JSON protocol Lab speaks): (reply, outputs)."""
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "test", "session": msg_id,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": "5.3"}  # fmt: skip
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": True}  # fmt: skip
    ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                        "channel": "shell", "buffers": []}))  # fmt: skip
    reply, idle, outputs = None, False, []
    deadline = time.monotonic() + CELL_TIMEOUT_S
    while reply is None or not idle:
        ws.settimeout(max(0.1, deadline - time.monotonic()))
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        if kind == "execute_reply":
            reply = msg["content"]
        elif kind == "status":
            idle = msg["content"]["execution_state"] == "idle"
        elif kind in ("stream", "display_data", "execute_result", "error"):
            outputs.append({"output_type": kind, **msg["content"]})
    return reply, outputs


def test_kernel_through_the_server_runs_a_notebook_in_quick_mode(lab):
    session = lab.api(
        "/api/sessions",
        method="POST",
        body={"path": RUN_NOTEBOOK, "type": "notebook", "name": "", "kernel": {"name": "python3"}},
    )
    kernel = session["kernel"]["id"]
    cells = []
    for cell in jupytext.read(NB_DIR / RUN_NOTEBOOK).cells:
        if cell.cell_type == "code":
            cells.append(cell.source)
            if "parameters" in cell.metadata.get("tags", []):
                cells.append("quick = True")  # what papermill injects; a Lab user edits the cell
    outputs = []
    try:
        with kernel_channel(lab, kernel) as ws:
            for i, code in enumerate(cells):
                reply, out = _execute(ws, code)
                errors = [f"{o['ename']}: {o['evalue']}" for o in out if o["output_type"] == "error"]
                assert reply["status"] == "ok" and not errors, f"cell {i} of {RUN_NOTEBOOK}: {errors}"
                outputs += out
    finally:
        lab.api(f"/api/sessions/{session['id']}", method="DELETE")
    mimes = {m for o in outputs for m in o.get("data", {})}
    assert "image/png" in mimes, f"no inline figure: {sorted(mimes)}"
    assert "application/vnd.jupyter.widget-view+json" in mimes, "no notebook progress bar (ipywidgets?)"
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any(re.search(r"^\|.*\|\s*$", t, re.M) for t in tables), "no markdown table among the outputs"


# --------------------------------------------------------------------------------------------------
# The Lab page in headless Chromium
# --------------------------------------------------------------------------------------------------


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.fail("no Chromium: `make browserdeps` installs Debian's chromium (or set CHROMIUM=/path)")


class _DomSummary(HTMLParser):
    """Class names of the elements, the visible text and the <h1> headings of a dumped DOM."""

    def __init__(self):
        super().__init__()
        self.classes: list[set[str]] = []
        self.text: list[str] = []
        self.h1: list[str] = []
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.classes.append(set((dict(attrs).get("class") or "").split()))
        self._in.append(tag)

    def handle_endtag(self, tag):
        if tag in self._in:
            del self._in[len(self._in) - 1 - self._in[::-1].index(tag) :]

    def handle_data(self, data):
        if not any(t in ("style", "script") for t in self._in):
            self.text.append(data)
        if "h1" in self._in and data.strip() not in ("", "\u00b6"):  # not Lab's anchor-link pilcrow
            self.h1.append(data.strip())

    def count(self, cls: str) -> int:
        return sum(cls in c for c in self.classes)


def dump_dom(chromium: str, url: str, tmp: Path, budget_ms: int) -> str:
    """The DOM after `budget_ms` of the page's virtual time (timers run fast, network fetches pause it)."""
    home = tmp / "home"
    home.mkdir(parents=True, exist_ok=True)
    cmd = [chromium, "--headless", "--no-sandbox",  # --no-sandbox: root, and containers without user namespaces
           "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url]  # fmt: skip
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home), "XDG_CACHE_HOME": str(home)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_left_over(proc, tmp / "profile")  # also helpers outliving the browser
    return out.decode(errors="replace")


def test_a_click_in_lab_opens_the_notebook_as_a_notebook(lab):
    chromium = find_chromium()
    url = f"{lab.base}/lab/tree/{BROWSER_NOTEBOOK}?token={lab.token}"
    expected = jupytext.read(NB_DIR / BROWSER_NOTEBOOK).cells
    for attempt, budget_ms in enumerate((20_000, 60_000)):  # under Lab's 120 s autosave interval
        dom = _DomSummary()
        dom.feed(dump_dom(chromium, url, lab.tmp / f"chromium-{attempt}", budget_ms))
        if dom.count("jp-Cell") or dom.count("jp-FileEditor"):
            break  # Lab drew the document (a longer budget only for a page that was not drawn yet)
    cells, editors = dom.count("jp-Cell"), dom.count("jp-FileEditor")
    heading = expected[0].source.splitlines()[0].lstrip("# ")
    text = " ".join(dom.text)
    print(
        f"DOM of {BROWSER_NOTEBOOK} in Lab: {cells} jp-Cell elements ({dom.count('jp-CodeCell')} code, "
        f"{dom.count('jp-MarkdownCell')} markdown; the notebook has {len(expected)} cells), "
        f"{editors} jp-FileEditor, <h1> headings {dom.h1}, "
        f"news toast {'shown' if NEWS_TOAST in text else 'absent'}"
    )
    assert editors == 0, "Lab opened the notebook in the text editor (defaultViewers not in effect?)"
    assert cells == len(expected), f"Lab drew {cells} notebook cells, the notebook has {len(expected)}"
    assert dom.count("jp-CodeCell") == sum(c.cell_type == "code" for c in expected)
    assert heading in dom.h1, f"the markdown heading {heading!r} is not rendered as <h1>"
    assert NEWS_TOAST not in text, "the first-run Jupyter news toast is shown"


# --------------------------------------------------------------------------------------------------
# Ctrl-C, and saving
# --------------------------------------------------------------------------------------------------


def test_ctrl_c_stops_make_lab_and_its_kernels(tmp_path):
    server = start_make_lab(tmp_path / "lab")
    try:
        kernel = server.api("/api/kernels", method="POST", body={"name": "python3"})["id"]
        with kernel_channel(server, kernel) as ws:  # a started kernel, not one still importing
            assert _execute(ws, "import os; os.getpid()")[0]["status"] == "ok"
        started = time.monotonic()
        status = ctrl_c(server, timeout=30)
        took = time.monotonic() - started
        out = server.output()
        assert status is not None, f"`make lab` still runs 30 s after Ctrl-C:\n{out[-2000:]}"
        assert "Shut down this Jupyter server" not in out, "Ctrl-C asked for a confirmation"
        assert "Traceback" not in out, out[-3000:]
        assert not processes_mentioning(str(server.tmp)), "a kernel outlived `make lab`"
        runtime = sorted(p.name for p in (server.tmp / "runtime").glob("*.json"))
        assert runtime == [], f"server/kernel files left behind: {runtime}"
        assert took < 15, f"Ctrl-C took {took:.1f} s"
    finally:
        stop_lab(server)


def test_saving_from_lab_keeps_the_py_as_the_source(tmp_path):
    from jupytext import TextFileContentsManager

    work = tmp_path / "notebooks"
    work.mkdir()
    shutil.copy(NB_DIR / "jupytext.toml", work)
    for name in NOTEBOOKS:
        shutil.copy(NB_DIR / name, work)
    cm = TextFileContentsManager(root_dir=str(work))
    for name in NOTEBOOKS:
        model = cm.get(name)
        cm.save({"type": "notebook", "content": model["content"]}, name)
        assert filecmp.cmp(NB_DIR / name, work / name, shallow=False), (
            f"saving {name} unchanged from Lab rewrote the .py (check notebooks/jupytext.toml's filters)"
        )
    written = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
    extra = [p for p in written if p != "jupytext.toml" and p not in NOTEBOOKS]
    assert extra, "expected the paired .ipynb copies (notebooks/jupytext.toml formats)"
    ignored = subprocess.run(
        ["git", "check-ignore", "--stdin", "--no-index"],
        input="\n".join(f"notebooks/{p}" for p in extra),
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout.split()
    assert sorted(ignored) == sorted(f"notebooks/{p}" for p in extra), "paired files git does not ignore"
