"""`sparseforge serve` as a command: its settings are checked before the model loads, every option has help, and
the real process prints its address, answers the `openai` client and stops cleanly on Ctrl-C."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from test_runtime_cli import PROMPT, engine_checkpoint  # noqa: E402

from sparseforge.cli import build_parser, main  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.runtime.server import ServerSettings  # noqa: E402

KEY = "test-key"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return engine_checkpoint(tmp_path_factory.mktemp("server-cli"))


def test_exposed_host_needs_a_key_or_explicit_consent(capsys):
    with pytest.raises(SparseforgeError, match=r"--host 0\.0\.0\.0 is reachable .* pass --api-key KEY .* or --allow-no-api-key"):
        ServerSettings(host="0.0.0.0").check()
    ServerSettings(host="0.0.0.0", api_key="k").check()
    ServerSettings(host="0.0.0.0", allow_no_api_key=True).check()
    for host in ("127.0.0.1", "localhost", "::1"):
        ServerSettings(host=host).check()
    with pytest.raises(SparseforgeError, match="--default-max-tokens 300 exceeds --max-tokens-limit 200"):
        ServerSettings(default_max_tokens=300, max_tokens_limit=200).check()
    # the CLI refuses before loading the model: one line naming the fix
    assert main(["serve", "no-such-checkpoint", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key" in err and "--allow-no-api-key" in err


def test_every_serve_option_has_help(capsys):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert all(a.help for a in serve._actions), [a.dest for a in serve._actions if not a.help]
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--api-key", "--allow-no-api-key", "--max-tokens-limit", "--max-queue", "--max-body-bytes", "--host", "--port"):
        assert flag in out


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~10 s idle, more on a busy machine
def test_serve_command_starts_answers_and_stops_on_ctrl_c(ckpt):
    """`sparseforge serve --port 0` prints its address, wants the key from SPARSEFORGE_API_KEY, exits cleanly on SIGINT."""
    import os
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sparseforge.cli", "serve", str(ckpt), "--port", "0", "--mode", "dense", "--threads", "1",
                             "--no-progress", "--model-name", "cli-tiny"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SPARSEFORGE_API_KEY": KEY})  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert "API key required" in line, line
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line).group(1)
        c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        assert [m.id for m in c.models.list().data] == ["cli-tiny"]
        assert c.completions.create(model="cli-tiny", prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.stderr.close()
