"""The container images (deploy/Dockerfile, and deploy/Dockerfile.vllm: vLLM with kvsched's
KV connector), which cannot be built on this machine: every path they copy from the context
exists and is not left out by .dockerignore, hadolint and checkov pass them, and the wheel
they install runs every service's command from its own files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest

from services.cli import COMMANDS
from services.launcher.ports import free_port
from tests.deploy.dockerignore import DockerIgnore
from tests.deploy.tools import DEPLOY, ROOT, run_tool
from tests.fixtures.poll import wait_for
from tests.fixtures.process import ServiceProcess

DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))
SERVICES = ("conductor", "router", "messenger", "engine")


def context_copies(dockerfile: Path) -> list[str]:
    """The sources of every COPY (and ADD) that reads the build context (not `--from=`)."""
    sources = []
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources += args[:-1]
    return sources


def tracked_files(relative: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--", relative], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_is_in_the_context(dockerfile: Path) -> None:
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    sources = context_copies(dockerfile)
    assert "pyproject.toml" in sources and "services" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"deploy/Dockerfile copies {source}, which is missing"
        files = tracked_files(source)
        assert files, f"{source} holds no tracked file"
        left_out = [f for f in files if ignore.excludes(f)]
        assert not left_out, f".dockerignore leaves out what the Dockerfile copies: {left_out}"


def test_dockerignore_matches_as_docker_does() -> None:
    ignore = DockerIgnore(("*", "!services/", "**/__pycache__", "!keep/**/x.py"))
    assert ignore.excludes("tests/test_imports.py")
    assert not ignore.excludes("services/cli.py")
    assert ignore.excludes("services/router/__pycache__/server.cpython-311.pyc")
    assert not ignore.excludes("keep/a/b/x.py")
    assert ignore.excludes("keep/a/b/y.py")


def test_the_package_sources_are_all_copied() -> None:
    """Every package pyproject installs is in the image's context, or the wheel lacks it."""
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for package in ("kvsched", "services", "clients"):
        for path in tracked_files(package):
            if path.endswith(".py") or path.startswith("kvsched/data/"):
                assert not ignore.excludes(path), f"{path} is left out of the image"


def test_entrypoint_is_the_kvsched_command() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert 'ENTRYPOINT ["kvsched"]' in text
    assert 'kvsched = "services.cli:main"' in (ROOT / "pyproject.toml").read_text()
    assert set(SERVICES) <= set(COMMANDS)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = run_tool("hadolint", "--no-color", str(dockerfile))
    assert result.returncode == 0, result.stdout + result.stderr


def test_checkov_passes_the_dockerfiles() -> None:
    args = [arg for path in DOCKERFILES for arg in ("-f", str(path))]
    result = run_tool(
        "checkov", *args, "--framework", "dockerfile", "--skip-download", "--quiet", "-o", "json"
    )
    report = json.loads(result.stdout)
    assert report["summary"]["failed"] == 0, report["results"]["failed_checks"]
    assert report["summary"]["passed"] > 40 * len(DOCKERFILES)
    for check in report["results"].get("skipped_checks", []):
        reason = (check.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, f"{check['check_id']} skipped without a reason"


def test_the_vllm_image_builds_its_wheel_with_vllms_own_python() -> None:
    """The wheel holds a compiled extension, so it is built on the image it runs on."""
    text = (DEPLOY / "Dockerfile.vllm").read_text()
    bases = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert len(bases) == 2 and bases[0] == bases[1], bases
    assert "COPY --from=build /wheels /wheels" in text
    assert "pip install --no-cache-dir --no-deps /wheels/kvsched-*.whl" in text


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as the image's first stage builds it: from the build
    context (the tracked files .dockerignore lets through, copied apart, so that nothing is
    written into the checkout), unpacked into a folder of its own (its dependencies are the
    test environment's)."""
    out = tmp_path_factory.mktemp("wheel")
    context = out / "context"
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for path in tracked_files("."):
        if not ignore.excludes(path):
            (context / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, context / path)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--wheel-dir", str(out), str(context)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = out.glob("kvsched-*.whl")
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_the_wheel_holds_the_package_data(installed_wheel: Path) -> None:
    for data in tracked_files("kvsched/data"):
        assert (installed_wheel / data).is_file(), f"the wheel lacks {data}"


def test_what_only_some_roles_use_is_an_extra(installed_wheel: Path) -> None:
    """The Mooncake backend (a Messenger's) and matplotlib (the simulator's figures) are
    extras; the image installs the first."""
    (metadata,) = installed_wheel.glob("kvsched-*.dist-info/METADATA")
    needs = [line for line in metadata.read_text().splitlines() if line.startswith("Requires-Dist")]
    mooncake = [n for n in needs if n.startswith("Requires-Dist: mooncake-transfer-engine")]
    figures = [n for n in needs if n.startswith("Requires-Dist: matplotlib")]
    assert len(mooncake) == 1 and mooncake[0].endswith('extra == "mooncake"'), mooncake
    assert len(figures) == 1 and figures[0].endswith('extra == "figures"'), figures
    assert '"${whl}[mooncake]"' in DOCKERFILE.read_text(encoding="utf-8")


def test_the_wheel_holds_the_compiled_index_and_scoring(installed_wheel: Path) -> None:
    """The prefix index's, the scoring's and the simulator cache's C extensions, built from the
    context's setup.py, and the stubs that type them."""
    for name in ("core/_holdings", "core/_scoring", "cache/_cache"):
        assert list((installed_wheel / "kvsched").glob(f"{name}*.so")), f"no {name}"
    for stub in ("core/_holdings.pyi", "core/_scoring.pyi", "cache/_cache.pyi"):
        assert (installed_wheel / "kvsched" / stub).is_file(), f"no {stub}"


@pytest.mark.parametrize("command", SERVICES)
def test_every_service_runs_from_the_wheel(installed_wheel: Path, command: str) -> None:
    """`kvsched COMMAND --help` from the wheel's files alone (not this checkout's), and the
    shipped tokenizer found beside the installed package."""
    site = str(installed_wheel)
    probe = (
        f"import sys; sys.path.insert(0, {site!r}); "
        "import services.cli, kvsched.data_files as d; "
        f"assert services.cli.__file__.startswith({site!r}), services.cli.__file__; "
        "assert d.data_path('tokenizer', 'tokenizer.json').is_file(); "
        "sys.exit(services.cli.main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe, command, "--help"],
        cwd=installed_wheel.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"kvsched {command}" in result.stdout


async def test_an_engine_serves_from_the_wheel(installed_wheel: Path, tmp_path: Path) -> None:
    """`kvsched engine` started from the wheel's files alone loads its shipped tokenizer and
    model data and serves /health."""
    port = free_port()
    site = str(installed_wheel)
    start = (
        f"import sys; sys.path.insert(0, {site!r}); import services.cli; "
        "sys.exit(services.cli.main(sys.argv[1:]))"
    )
    log = tmp_path / "engine.log"
    engine = ServiceProcess(
        [sys.executable, "-I", "-c", start, "engine", "--listen", f"127.0.0.1:{port}",
         "--kv-memory-dir", str(tmp_path)],
        log,
    )  # fmt: skip

    async def healthy() -> bool:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/health") as answer,
            ):
                return answer.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await wait_for(healthy, 60.0, interval=0.1, message=f"the engine ({log})")
        assert engine.process.poll() is None
    finally:
        engine.stop()
    assert "Traceback" not in log.read_text()
