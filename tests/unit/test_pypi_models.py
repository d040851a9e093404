"""PyPI-shipped models by short name: a model split over several packages is assembled in
order into the cache directory, checked against its SHA-256, and found by `--model NAME`."""

import hashlib
import sys

import pytest

from vllm_actors.errors import ModelNotFoundError
from vllm_actors.loaders import pypi_models
from vllm_actors.loaders.model_files import resolve_model


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """Three fake part packages on sys.path and a catalog entry naming them."""
    pieces = [b"GGUF" + bytes(range(200)), b"\x01" * 1000, b"tail"]
    for i, piece in enumerate(pieces):
        pkg = tmp_path / "site" / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"m.gguf.part{i:02d}").write_bytes(piece)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("VLLM_ACTORS_CACHE", str(tmp_path / "cache"))
    whole = b"".join(pieces)
    entry = pypi_models.PypiModel(
        "fake", "m.gguf", ("fake-model",),
        tuple((f"fake_model_part{i}", f"data/m.gguf.part{i:02d}") for i in range(3)),
        hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(pypi_models.CATALOG, "fake", entry)
    yield entry, whole
    for i in range(3):
        sys.modules.pop(f"fake_model_part{i}", None)


def test_parts_are_assembled_in_order_and_found_by_name(split_model, tmp_path):
    entry, whole = split_model
    assert pypi_models.model_path("fake") is None
    with pytest.raises(ModelNotFoundError, match="vllm-actors pull fake"):
        resolve_model("fake")
    path = pypi_models._assemble(entry)
    assert path == tmp_path / "cache" / "m.gguf" and path.read_bytes() == whole
    assert resolve_model("fake").path == path
    assert not list((tmp_path / "cache").glob("*.partial-*"))


def test_a_wrong_checksum_leaves_no_file(split_model, tmp_path, monkeypatch):
    entry, _ = split_model
    monkeypatch.setitem(pypi_models.CATALOG, "fake",
                        pypi_models.PypiModel(entry.name, entry.file_name, entry.distributions,
                                              entry.parts, "0" * 64))
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        pypi_models._assemble(pypi_models.CATALOG["fake"])
    assert not list((tmp_path / "cache").iterdir())


def test_unknown_names_are_refused():
    with pytest.raises(ModelNotFoundError, match="known: smollm2"):
        pypi_models.pull("no-such-model")
