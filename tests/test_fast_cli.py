"""Admin commands and ``diloco --help`` never import torch.

Importing torch takes seconds on a loaded machine; an operator's ``diloco
status`` needs none of it (an ``AdminRequest`` carries no tensors). Each
check runs in a fresh interpreter, since this test process has long
imported torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

#: Appended to each snippet: fail naming the heavy modules that got loaded.
_NO_TORCH = textwrap.dedent("""
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
    assert "torch" not in sys.modules, f"torch was imported ({len(loaded)} torch modules: {loaded[:5]})"
    print("NO_TORCH_OK")
""")


def _run_python(args: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_ENV, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_parser_admin_client_and_admin_messages_import_no_torch():
    code = textwrap.dedent("""
        import sys

        import diloco.cli
        parser = diloco.cli.build_parser()
        for argv in (["status"], ["shutdown"], ["set-min-workers", "2"], ["kick", "w1"]):
            assert parser.parse_args(argv).handler is not None, argv

        import diloco.deploy.admin
        import diloco.wire.zmq
        from diloco.wire import codec
        from diloco.wire.messages import AdminReply, AdminRequest

        req = AdminRequest("set_min_workers", {"min_workers": 2})
        assert codec.decode(codec.encode(req)) == req
        rep = AdminReply(True, {"members": [{"worker_id": "w1", "age_s": 0.5}], "phase": "running"})
        assert codec.decode(codec.encode(rep)) == rep
    """) + _NO_TORCH
    proc = _run_python(["-c", code])
    assert proc.returncode == 0 and "NO_TORCH_OK" in proc.stdout, proc.stdout + proc.stderr


def test_the_shared_test_helpers_import_no_torch():
    """``diloco.testing`` stays cheap to import: the helpers that need torch import it when called."""
    code = textwrap.dedent("""
        import sys

        from diloco.testing import join_message
        from diloco.wire.messages import PROTOCOL_VERSION, TensorSpec

        msg = join_message("w1", (TensorSpec("w", (2,), "float32"),))
        assert msg.protocol_version == PROTOCOL_VERSION and msg.params == {} and msg.spec[0].name == "w"
    """) + _NO_TORCH
    proc = _run_python(["-c", code])
    assert proc.returncode == 0 and "NO_TORCH_OK" in proc.stdout, proc.stdout + proc.stderr


def test_codec_still_decodes_tensors_after_the_lazy_dtype_table():
    """The other side of the laziness: the first tensor loads torch and round-trips every wire dtype."""
    code = textwrap.dedent("""
        import sys

        from diloco.wire import codec
        from diloco.wire.messages import Join, TensorSpec
        assert "torch" not in sys.modules

        import torch
        params = {name: torch.zeros(2, 3, dtype=getattr(torch, name)) for name in codec.WIRE_DTYPES}
        spec = tuple(TensorSpec.of(n, t) for n, t in params.items())
        out = codec.decode(codec.encode(Join("w1", 2, spec, params)))
        for name, t in params.items():
            assert out.params[name].dtype == t.dtype and torch.equal(out.params[name], t), name
            assert t.element_size() == codec.WIRE_DTYPES[name], name
        assert codec.DTYPES["bfloat16"] is torch.bfloat16
        print("TENSORS_OK")
    """)
    proc = _run_python(["-c", code])
    assert proc.returncode == 0 and "TENSORS_OK" in proc.stdout, proc.stdout + proc.stderr


def _run_diloco_without_torch(cli_args: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m diloco CLI_ARGS`` in a fresh interpreter; prints NO_TORCH_OK at exit if torch never loaded."""
    code = textwrap.dedent("""
        import atexit, runpy, sys

        def _check():
    """) + textwrap.indent(_NO_TORCH, "    ") + textwrap.dedent(f"""
        atexit.register(_check)
        sys.argv = ["diloco", *{cli_args!r}]
        runpy.run_module("diloco", run_name="__main__", alter_sys=True)
    """)
    return _run_python(["-c", code], timeout_s=timeout_s)


def test_status_against_nothing_exits_3_without_importing_torch():
    port = _free_port()
    proc = _run_diloco_without_torch(["status", "--connect", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "unreachable" in proc.stderr, proc.stderr
    assert "NO_TORCH_OK" in proc.stdout, proc.stdout + proc.stderr


def test_help_of_diloco_and_of_each_admin_command_imports_no_torch():
    for cli_args in (["--help"], ["status", "--help"], ["shutdown", "--help"], ["set-min-workers", "--help"],
                     ["kick", "--help"], ["plan", "--help"]):
        proc = _run_diloco_without_torch(cli_args)
        assert proc.returncode == 0, (cli_args, proc.stdout + proc.stderr)
        assert "usage: diloco" in proc.stdout, (cli_args, proc.stdout)
        assert "NO_TORCH_OK" in proc.stdout, (cli_args, proc.stdout + proc.stderr)


def test_python_m_diloco_help_importtime_names_no_torch():
    """The plain ``python -m diloco --help`` process, as an operator runs it: ``-X importtime`` lists every import."""
    proc = _run_python(["-X", "importtime", "-m", "diloco", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "diloco.cli" in imported, proc.stderr[-2000:]
    assert "torch" not in imported, sorted(m for m in imported if m.startswith("torch"))[:10]
