"""A signed artifact attacked as a stranger would: files swapped between the signature check
and the read, forged ``model.sig`` files, keys of other kinds, files added after signing.

``load(verify_signature=)`` must load the signed model or refuse with the library's error,
in bounded time, whatever the directory holds or becomes while it is read.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import mmap
import os
import shutil
import threading
import time

import jax
import model_signing.hashing
import model_signing.verifying
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID
from fuzzing import forge
from helpers import bounded

import symjax_mlp as sm
from symjax_mlp import _signing
from symjax_mlp._artifact import reading
from symjax_mlp.cli import main

PEM, SPKI = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo


def _keys(d, name, key):
    private = key.private_bytes(
        PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (d / f"{name}.pem").write_bytes(private)
    (d / f"{name}.pub").write_bytes(key.public_key().public_bytes(PEM, SPKI))
    return d / f"{name}.pem", d / f"{name}.pub"


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A signed MLP, its keys, its input, and a twin: the same MLP with other weights, whose
    manifest, weights and self-test have exactly the sizes of the signed one's."""
    d = tmp_path_factory.mktemp("signed")
    private, public = _keys(d, "ours", ec.generate_private_key(ec.SECP256R1()))
    art, x = forge.base(d / "mlp")
    sm.sign(art, private)
    net = sm.mlp((4, 2))
    h = sm.hybridize(net, net.init(jax.random.key(7), x))
    twin = sm.export(h, d / "twin", example=x).path
    return art, private, public, x, twin


def _copy(signed, tmp_path):
    return shutil.copytree(signed[0], tmp_path / "art")


def _after_verification(monkeypatch, act):
    """Runs ``act()`` right after model-signing verified the directory."""
    verify = model_signing.verifying.Config.verify

    def verified(self, *args, **kwargs):
        verify(self, *args, **kwargs)
        act()

    monkeypatch.setattr(model_signing.verifying.Config, "verify", verified)


# -- 1. time of check, time of use ---------------------------------------------------------------
def test_files_rewritten_through_a_shared_mmap_after_verification_are_refused(
    signed, tmp_path, monkeypatch
):
    """A write through a shared writable mapping whose pages are dirty already changes the
    bytes and no metadata (no ctime, inode or size): the signature's file snapshot missed
    it, and load ran the twin's weights as the signed model."""
    _, _, public, x, twin = signed
    art = _copy(signed, tmp_path)
    swap = _twin_bytes(art, twin)
    maps = {}
    for name, data in swap.items():
        assert len(data) == (art / name).stat().st_size
        with open(art / name, "r+b") as f:
            maps[name] = mmap.mmap(f.fileno(), 0)
        maps[name][:] = maps[name][:]  # dirty the pages now: later writes update no ctime
    ours = sm.load(art)(x)

    def rewrite():
        for name, data in swap.items():
            maps[name][:] = data

    _after_verification(monkeypatch, rewrite)
    try:
        with pytest.raises(sm.ArtifactError, match="changed while it was verified and read"):
            got = sm.load(art, verify_signature=public)(x)
            np.testing.assert_array_equal(got, ours)  # (the signed model, at least)
    finally:
        for m in maps.values():
            m.close()


def _twin_bytes(art, twin):
    """The twin's weights and self-test, and the signed manifest naming their digests: files
    of the signed ones' sizes that make a consistent artifact."""
    names = ("params.safetensors", "selftest.safetensors")
    text = (art / "manifest.json").read_bytes()
    listed = json.loads(text)["files"]
    for name in names:
        digest = hashlib.sha256((twin / name).read_bytes()).hexdigest()
        text = text.replace(listed[name]["sha256"].encode(), digest.encode())
    return {"manifest.json": text, **{n: (twin / n).read_bytes() for n in names}}


@pytest.mark.slow
def test_a_thread_rewriting_a_signed_artifact_through_mmap_never_gets_its_twin_loaded(
    signed, tmp_path
):
    """No hook: a thread flips the files between the signed bytes and the twin's, through
    shared mappings (no metadata changes), while loads run without the self-test; before the
    fix about one load in 45 returned the twin's model."""
    _, _, public, x, twin = signed
    art = _copy(signed, tmp_path)
    theirs = _twin_bytes(art, twin)
    ours = {name: (art / name).read_bytes() for name in theirs}
    maps = {}
    for name in theirs:
        with open(art / name, "r+b") as f:
            maps[name] = mmap.mmap(f.fileno(), 0)
        maps[name][:] = ours[name]
    want = np.asarray(sm.load(art)(x))
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            for files in (theirs, ours):
                for name, data in files.items():
                    maps[name][:] = data
                time.sleep(0.0003)

    racer = threading.Thread(target=flip, daemon=True)
    racer.start()
    loaded = refused = 0
    try:
        while loaded + refused < 600:
            try:
                m = sm.load(art, verify_signature=public, self_test=False)
            except sm.ArtifactError:
                refused += 1
                continue
            np.testing.assert_array_equal(np.asarray(m(x)), want)
            loaded += 1
    finally:
        stop.set()
        racer.join()
        for m in maps.values():
            m.close()
    assert refused > 0  # the race ran


def test_a_directory_swapped_for_a_twin_and_back_while_it_is_read_is_refused(
    signed, tmp_path, monkeypatch
):
    """A stranger renames a consistent twin (another manifest: its name, its ``needs``) over
    the verified directory before load reads it, and the signed one back before each
    metadata check: every check saw the signed files, the loader read the twin's."""
    _, _, public, _, _ = signed
    art = _copy(signed, tmp_path)
    twin = shutil.copytree(art, tmp_path / "twin")
    edit = json.loads((twin / "manifest.json").read_text())
    edit.update(name="not-signed", needs=["while", "sort"])
    (twin / "manifest.json").write_text(json.dumps(edit))
    state = {"in": False}

    def swap():
        os.rename(art, tmp_path / "parked")
        os.rename(twin, art)
        os.rename(tmp_path / "parked", twin)
        state["in"] = not state["in"]

    read, snapshot = reading.read_manifest, _signing.snapshot

    def twin_read(path):
        swap()  # the twin in place as load reads
        return read(path)

    def checked(path, call):
        if state["in"]:
            swap()  # the signed one back for the check
        return snapshot(path, call)

    monkeypatch.setattr(reading, "read_manifest", twin_read)
    monkeypatch.setattr(_signing, "snapshot", checked)
    with pytest.raises(sm.ArtifactError, match="changed while it was verified and read"):
        m = sm.load(art, verify_signature=public)
        assert m.manifest["name"] != "not-signed"  # (the signed manifest, at least)


def test_a_signature_swapped_after_it_is_read_is_not_what_is_parsed(signed, tmp_path, monkeypatch):
    """model.sig is read once: the bytes model-signing verifies are those whose digests are
    compared; another artifact's signature written there meanwhile changes nothing."""
    _, _, public, _, _ = signed
    art = _copy(signed, tmp_path)
    other = shutil.copytree(art, tmp_path / "other")
    (other / "manifest.json").write_text((other / "manifest.json").read_text() + " ")
    sm.sign(other, signed[1])
    _after_verification(monkeypatch, lambda: shutil.copy(other / "model.sig", art / "model.sig"))
    with pytest.raises(sm.ArtifactError, match="changed while it was verified and read"):
        sm.load(art, verify_signature=public)


# -- 2. model.sig forged -------------------------------------------------------------------------
def _resigned(edit):
    """model.sig's payload edited by ``edit`` and signed again with the artifact's own key:
    only the key's holder can make such a signature; it is refused all the same."""

    def forge_it(art, private):
        bundle = json.loads((art / "model.sig").read_text())
        envelope = bundle["dsseEnvelope"]
        statement = json.loads(base64.b64decode(envelope["payload"]))
        edit(statement["predicate"]["resources"])
        payload, kind = json.dumps(statement).encode(), envelope["payloadType"].encode()
        pae = b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)
        key = serialization.load_pem_private_key(private.read_bytes(), None)
        envelope["payload"] = base64.b64encode(payload).decode()
        signature = key.sign(pae, ec.ECDSA(hashes.SHA256()))
        envelope["signatures"][0]["sig"] = base64.b64encode(signature).decode()
        (art / "model.sig").write_text(json.dumps(bundle))

    return forge_it


def _sparse(file, size):
    with open(file, "wb") as f:
        f.truncate(size)


def _other_artifacts(art, private):
    other = shutil.copytree(art, art.parent / "other")
    (other / "selftest.safetensors").write_bytes(b"other")
    sm.sign(other, private)
    shutil.copy(other / "model.sig", art / "model.sig")


def _linked(art, private):
    (art / "params.safetensors").unlink()
    (art / "params.safetensors").symlink_to(art.parent / "elsewhere.safetensors")
    (art.parent / "elsewhere.safetensors").write_bytes(b"\0" * 8)


FORGED = {
    "1 GB sparse": (lambda a, p: _sparse(a / "model.sig", 1 << 30), r"more than 1048576 bytes"),
    "nested JSON": (lambda a, p: (a / "model.sig").write_text("[" * 400_000 + "]" * 400_000),
                    r"does not verify .*RecursionError"),
    "JSON nested in a field": (
        lambda a, p: (a / "model.sig").write_text('{"mediaType": ' + "[" * 99_999
                                                  + "]" * 99_999 + "}"),
        r"does not verify"),
    "binary": (lambda a, p: (a / "model.sig").write_bytes(os.urandom(4096)), r"does not verify"),
    "empty": (lambda a, p: (a / "model.sig").write_bytes(b""), r"does not verify"),
    "another artifact's": (_other_artifacts, r"signs other contents of selftest.safetensors"),
    "a file more": (_resigned(lambda r: r.append(dict(r[0], name="extra.bin"))),
                    r"does not verify .*inconsistent"),
    "a file less": (_resigned(lambda r: r.pop()), r"does not verify .*inconsistent"),
    "a path with ..": (_resigned(lambda r: r.append(dict(r[0], name="../art/manifest.json"))),
                       r"does not verify .*inconsistent"),
    "an absolute path": (_resigned(lambda r: r.append(dict(r[0], name="/etc/passwd"))),
                         r"does not verify .*inconsistent"),
    "a name twice": (_resigned(lambda r: r.append(dict(r[1], name="manifest.json"))),
                     r"does not verify .*inconsistent"),
    "a directory": (lambda a, p: ((a / "model.sig").unlink(), (a / "model.sig").mkdir()),
                    r"model.sig is a directory; it is no signature"),
    "a FIFO": (lambda a, p: ((a / "model.sig").unlink(), os.mkfifo(a / "model.sig")),
               r"model.sig is not a regular file"),
    "a symlink to a signed file elsewhere": (_linked, r"params.safetensors is not a regular file"),
}  # fmt: skip


@pytest.mark.parametrize("case", FORGED)
def test_a_forged_signature_is_refused_naming_what_and_what_to_do(signed, tmp_path, case):
    _, private, public, _, _ = signed
    art = _copy(signed, tmp_path)
    forge_it, says = FORGED[case]
    forge_it(art, private)
    with pytest.raises(sm.ArtifactError, match=says) as info:
        bounded(lambda: sm.load(art, verify_signature=public), 30)
    message = str(info.value)
    assert message.startswith(f'symjax_mlp.load("{art}", verify_signature=...): ')
    assert any(fix in message for fix in ("refusing it", "Ask its author", "sign"))
    assert ". ." not in message and len(message) < 1500


def _certificate(file):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "signer")])
    when = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name)
    builder = builder.public_key(key.public_key()).serial_number(1).not_valid_before(when)
    cert = builder.not_valid_after(when + datetime.timedelta(days=365)).sign(key, hashes.SHA256())
    file.write_bytes(cert.public_bytes(PEM))


def _public(key):
    return lambda f: f.write_bytes(key.public_key().public_bytes(PEM, SPKI))


KEYS = {
    "an RSA key": (_public(rsa.generate_private_key(public_exponent=65537, key_size=1024)),
                   sm.ConfigError, r"holds an RSAPublicKey; expected .*elliptic-curve"),
    "an Ed25519 key": (_public(ed25519.Ed25519PrivateKey.generate()), sm.ConfigError,
                       r"holds an Ed25519PublicKey"),
    "a P-384 key": (_public(ec.generate_private_key(ec.SECP384R1())), sm.ArtifactError,
                    r"does not verify with .*Key mismatch"),
    "a certificate": (_certificate, sm.ConfigError, r"holds a certificate, not a key \(its key: "
                      r"openssl x509 -pubkey"),
    "an empty file": (lambda f: f.write_bytes(b""), sm.ConfigError, r"holds no PEM public key"),
    "binary bytes": (lambda f: f.write_bytes(os.urandom(4096)), sm.ConfigError, r"no PEM public"),
    "a 1 GB sparse file": (lambda f: _sparse(f, 1 << 30), sm.ConfigError, r"no PEM public key"),
    "a directory": (lambda f: f.mkdir(), sm.ConfigError, r"not a key file \(a directory is"),
    "a FIFO": (lambda f: os.mkfifo(f), sm.ConfigError, r"not a key file \(a FIFO"),
}  # fmt: skip


@pytest.mark.parametrize("case", KEYS)
def test_a_key_of_another_kind_is_refused_naming_it_and_what_to_pass(signed, tmp_path, case):
    art, _, _, _, _ = signed
    make, error, says = KEYS[case]
    key = tmp_path / "key.pub"
    make(key)
    with pytest.raises(error, match=says) as info:
        bounded(lambda: sm.load(art, verify_signature=key), 30)
    assert "Pass" in str(info.value) or "refusing it" in str(info.value)
    assert ". ." not in str(info.value)


@pytest.mark.parametrize("command", ["serve", "run", "verify"])
def test_the_command_line_refuses_a_forged_signature_without_a_traceback(
    signed, tmp_path, capsys, command
):
    _, _, public, x, _ = signed
    art = _copy(signed, tmp_path)
    _sparse(art / "model.vmfb", 1 << 40)  # added after signing: never hashed
    np.save(tmp_path / "x.npy", x)
    io = ["--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]
    extra = {"run": io, "serve": ["--dispatch", "async"]}.get(command, [])
    argv = [command, str(art), "--key", str(public), *extra]
    assert bounded(lambda: main(argv), 60) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert "does not sign model.vmfb" in out.err
    assert not (tmp_path / "y.npy").exists()


# -- 3. files added after signing ----------------------------------------------------------------
ADDED = {
    "a compiled module": ("model.vmfb", None),
    "a file in a new directory": ("iree/model.vmfb", None),
    "a 1 TB sparse file": ("zz.bin", 1 << 40),  # model-signing hashed all of it, for hours
}


@pytest.mark.parametrize("case", ADDED)
def test_a_file_added_after_signing_is_refused_unread(signed, tmp_path, monkeypatch, case):
    _, _, public, _, _ = signed
    art = _copy(signed, tmp_path)
    name, size = ADDED[case]
    (art / name).parent.mkdir(exist_ok=True)
    if size:
        _sparse(art / name, size)
    else:
        (art / name).write_bytes(b"\x7fELF" + b"\0" * 60)
    monkeypatch.setattr(jax.export, "deserialize", lambda *a: pytest.fail("parsed unverified"))
    with pytest.raises(sm.ArtifactError, match=rf"does not verify .*: it does not sign {name}\."):
        bounded(lambda: sm.load(art, verify_signature=public), 30)
    with pytest.raises(sm.ArtifactError, match=rf"it does not sign {name}\."):
        bounded(lambda: sm.verify_signature(art, public), 30)


@pytest.mark.parametrize("name", ["params.safetensors", "model.jaxexport", "manifest.json"])
def test_a_listed_file_replaced_by_a_huge_one_is_refused_by_its_size_unhashed(
    signed, tmp_path, monkeypatch, name
):
    """A signed file replaced by a 10 GiB sparse one was hashed whole by model-signing before
    the mismatch refused it (1 GiB: 1.2 s to verify_signature, 5.5 s to load; 1 TB: hours).
    Now, the signature verified, its size against the manifest it signs refuses it, unhashed;
    a manifest listing the huge size, edited, is not the one signed: refused, the rest unread."""
    _, _, public, _, _ = signed
    art = _copy(signed, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    huge = "params.safetensors" if name == "manifest.json" else name
    listed, manifest["files"][huge]["bytes"] = manifest["files"][huge]["bytes"], 10 << 30
    _sparse(art / huge, 10 << 30)
    if name == "manifest.json":
        (art / name).write_text(json.dumps(manifest))
    hashed = lambda *a, **k: pytest.fail("model-signing hashed the files")  # noqa: E731
    monkeypatch.setattr(model_signing.hashing.Config, "hash", hashed)
    said = rf"does not verify .*: {huge} has 10,737,418,240 bytes, where the manifest it signs "
    said += rf"lists {listed:,} \(refused unread\)"
    if name == "manifest.json":
        said = r"does not verify .*: it signs other contents of manifest\.json\. The artifact"
    with pytest.raises(sm.ArtifactError, match=said):
        bounded(lambda: sm.load(art, verify_signature=public), 30)
    with pytest.raises(sm.ArtifactError, match=said):
        bounded(lambda: sm.verify_signature(art, public), 30)


def test_a_second_entry_point_added_to_the_manifest_is_refused(signed, tmp_path):
    _, _, public, _, _ = signed
    art = _copy(signed, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["entries"] = {"evil": {k: m[k] for k in ("name", "signature")}}
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(sm.ArtifactError, match=r"it signs other contents of manifest.json"):
        sm.load(art, verify_signature=public)


def _nested(art, levels, name="d" * 255):
    """``art/ddd.../ddd...``, ``levels`` deep: past PATH_MAX, made one directory at a time."""
    fd = os.open(art, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            fd, parent = os.open(name, os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
    finally:
        os.close(fd)


def test_directories_nested_past_path_max_are_an_artifact_error_naming_them_briefly(
    signed, tmp_path
):
    """Python's raw OSError (File name too long), with a 4 kB path, came out of sign,
    verify_signature and load(verify_signature=)."""
    _, private, public, _, _ = signed
    art = _copy(signed, tmp_path)
    _nested(art, 20)
    for call in (
        lambda: sm.load(art, verify_signature=public),
        lambda: sm.verify_signature(art, public),
        lambda: sm.sign(art, private),
    ):
        says = r"dd/dd.* cannot be read \(File name too long\); nothing was (verified|signed)\."
        with pytest.raises(sm.ArtifactError, match=says + " Pass the directory") as info:
            call()
        assert len(str(info.value)) < 800
