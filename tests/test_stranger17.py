"""Round seventeen of a stranger's attacks (session 64): whole, self-consistent hostile inputs
against what sixteen rounds left. An artifact listing sparse files under many names (hard
links), every size and sha256 right, which load, ``inspect`` and ``serve`` hashed for hours; a
client pipelining requests, which ``serve`` (uvicorn over httptools) parsed and queued without
end; two ``Content-Encoding`` lines. Each way in that got through has a test failing without
its fix; each surface that held keeps one test showing it (an artifact directory that is a
FIFO, a file or a device; chunk sizes past 2**64 or never sent; a request split byte by byte;
``Expect: 100-continue`` with a body past the limit). The rounds before: test_stranger16.py,
..., test_stranger9.py, test_http_hostile.py (slow clients, heads past 64 KiB, trailers,
``Content-Length`` forms, upgrades, a gzip body), test_security.py, test_signing_stranger.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from helpers import bounded

import symjax_mlp as sm
from symjax_mlp.cli import main

MB = 1 << 20


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The chapter's MLP exported, and its answer to one row of 0.5 (from a load of it)."""
    path = sm.chapter.export_mlp(tmp_path_factory.mktemp("s17") / "mlp").path
    x = np.full((1, 512), 0.5, np.float32)
    return path, np.asarray(sm.load(path)(x))


def _sparse_links(src, dst, size, names):
    """A copy of the artifact ``src`` listing ``names`` more files: one sparse file of ``size``
    zero bytes (no block on disk) under each name, a hard link each; sizes and sha256 right."""
    art = shutil.copytree(src, dst)
    digest, zeros = hashlib.sha256(), bytes(MB)
    for _ in range(size // MB):
        digest.update(zeros)
    manifest = json.loads((art / "manifest.json").read_text())
    with open(art / names[0], "wb") as f:
        f.truncate(size)
    for name in names:
        if name != names[0]:
            os.link(art / names[0], art / name)
        manifest["files"][name] = {"sha256": digest.hexdigest(), "bytes": size}
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return art


@pytest.mark.slow  # an export, 64 MiB hashed once here: ~2 s
def test_an_artifact_listing_sparse_files_under_many_names_is_refused_before_any_is_hashed(
    mlp, tmp_path, monkeypatch, capsys
):
    """A 64 MiB sparse file (no block on disk) listed under 129 names, hard links, every size
    and sha256 right: 8 GiB that load, ``inspect`` and ``serve`` hashed before anything else
    (2 s a GiB here: a terabyte under 1,024 names, the manifest's most, is weeks), then loaded.
    The files a load reads or hashes but the weights are now bounded by what an export writes
    (8 GiB), before a byte is read; at the bound's edge they are hashed and load as before."""
    from symjax_mlp._artifact import reading

    hashed = []  # each file the load hashed, by name
    hash_regular = reading.hash_regular
    monkeypatch.setattr(
        reading,
        "hash_regular",
        lambda file, **k: hashed.append(file.name) or hash_regular(file, **k),
    )
    names = [f"z{i}" for i in range(129)]
    art = _sparse_links(mlp[0], tmp_path / "links", 64 * MB, names)
    assert os.stat(art / "z0").st_nlink == 129 and os.stat(art / "z0").st_blocks == 0
    with pytest.raises(sm.ArtifactError) as e:
        bounded(lambda: sm.load(art), 60)
    said, listed = str(e.value), json.loads((art / "manifest.json").read_text())["files"]
    total = sum(f["bytes"] for name, f in listed.items() if name != "params.safetensors")
    assert said.startswith(f"{art / 'manifest.json'} lists 132 files besides params.safetensors")
    assert f"of {total:,} bytes" in said and "largest: z0 67,108,864, z1 67,108,864" in said, said
    assert "sparse, or linked under many names" in said and "\n" not in said, said
    assert hashed == []  # nothing read: the refusal comes from the manifest alone
    assert main(["inspect", str(art)]) == 2
    err = capsys.readouterr().err
    assert "lists 132 files besides" in err and "Traceback" not in err, err
    # two of the names listed (128 MiB), under the bound: each hashed, and the model loads
    for name in names[2:]:
        os.unlink(art / name)
        del listed[name]
    (art / "manifest.json").write_text(json.dumps({**json.loads(
        (art / "manifest.json").read_text()), "files": listed}))  # fmt: skip
    x = np.full((1, 512), 0.5, np.float32)
    np.testing.assert_array_equal(np.asarray(sm.load(art)(x)), mlp[1])
    assert {"z0", "z1"} <= set(hashed)  # each listed file hashed, as before


@pytest.mark.parametrize("kind", ["fifo", "file", "device"])
def test_an_artifact_path_that_is_a_fifo_a_file_or_a_device_is_refused_unopened(tmp_path, kind):
    """Held. A FIFO (whose ``open`` would block), a plain file or ``/dev/zero`` given as the
    artifact directory: an ArtifactError naming it, nothing opened."""
    path = {"fifo": tmp_path / "fifo", "file": tmp_path / "file", "device": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_text("{}")
    with pytest.raises(sm.ArtifactError, match="is a file, not an artifact directory"):
        bounded(lambda: sm.load(path), 60)
