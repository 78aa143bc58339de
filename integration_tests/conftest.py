from pathlib import Path

import pytest

from _launch import python_cmd, require_success, run, worker_env

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every test here is slow
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def home(tmp_path):
    """Private HF_HOME for one test's launches."""
    return tmp_path / "hf_home"


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained, for the from_pretrained scenarios."""
    root = tmp_path_factory.mktemp("ckpt")
    path = root / "tiny-llama"
    proc = run(python_cmd(["--save-checkpoint", str(path)]), worker_env(root / "hf_home"), root)
    require_success([proc])
    return path
