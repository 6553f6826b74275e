"""Who made an artifact: signing with the OpenSSF ``model-signing`` package, offline, by key.

Every file of the directory but ``model.sig`` (a Sigstore bundle) is signed, and verified
before any parser reads a byte; only regular files and directories are allowed. A loader then
checks that the manifest it parsed is the one signed (by its sha256 in ``model.sig``), whose
sha256s it checks each file it reads by: it uses the bytes signed, whatever changed meanwhile.
"""

from __future__ import annotations

import base64
import errno
import importlib
import itertools
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symjax_mlp._artifact.format import MAX_MANIFEST_BYTES, printable, unique_pairs
from symjax_mlp._errors import ArtifactError, ConfigError
from symjax_mlp._files import MANIFEST, SIGNATURE, exhausted, sha256, write_file_atomic
from symjax_mlp._reader import read_regular

MAX_ENTRIES = 4096
MAX_SIGNATURE_BYTES = 1 << 20


def _config(kind: str, first: Callable[[], None] | None = None) -> Any:
    """``model_signing.{kind}.Config()`` hashing every file but the signature, ``.git`` too;
    ``first()`` runs before, once a signature verified."""
    try:
        import model_signing.hashing

        module = importlib.import_module(f"model_signing.{kind}")
    except ImportError as e:
        raise ConfigError(
            "signing artifacts needs the optional package model-signing: "
            f"pip install 'symjax_mlp[sign]' ({e})"
        ) from e

    class Hashing(model_signing.hashing.Config):
        def hash(self, *args: Any, **kwargs: Any) -> Any:
            if first is not None:
                first()
            return super().hash(*args, **kwargs)

    hashing = Hashing()
    hashing.set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False)
    return module.Config().set_hashing_config(hashing)


#: the public call that checks a public key (``symjax_mlp.load`` calls :func:`check`)
_LOAD = ("symjax_mlp.load", "verify_signature")
#: what is at a path that is no regular file, by its ``stat`` mode
_KINDS = (
    (stat.S_ISDIR, "a directory is there"),
    (stat.S_ISFIFO, "a FIFO (named pipe) is there"),
    (stat.S_ISSOCK, "a socket is there"),
    (stat.S_ISCHR, "a character device is there"),
    (stat.S_ISBLK, "a block device is there"),
)


def _there(file: Path) -> str:
    """What is at ``file``, which is no regular file (or cannot be reached): for a message."""
    try:
        mode = os.stat(file).st_mode
    except ValueError as e:  # a NUL byte in the name
        return f"no file can be there: {e}"
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            return f"it cannot be read: {(e.strerror or str(e)).lower()}"
        return "a symbolic link to nothing is there" if os.path.islink(file) else "no file there"
    return next((said for test, said in _KINDS if test(mode)), "no regular file is there")


def _call(call: tuple[str, str], path: Path) -> str:
    """``symjax_mlp.load("dir", verify_signature=...)``: what a message about the artifact at
    ``path`` begins with, for ``call``, the public function and its keyword that took the key."""
    return f'{call[0]}("{printable(str(path)[:300])}", {call[1]}=...)'


def _checked(path: Any, key: Any, *, private: bool, call: tuple[str, str]) -> tuple[Path, Path]:
    """The artifact directory and the key file, checked: model-signing reports a key of
    another kind as a signature that does not verify, or as an AttributeError. ``call``: the
    public function called and its keyword that took the key, which the messages begin with."""
    from cryptography.hazmat.primitives import serialization as pem
    from cryptography.hazmat.primitives.asymmetric import ec

    fn, keyword = call
    what = f"{fn}({keyword}=...)"
    verb, kind = ("sign", "private") if private else ("verify", "public")
    if not isinstance(key, (str, os.PathLike)):
        raise ConfigError(
            f"{what}: pass the path of a PEM key file; got {type(key).__name__}. Write a key "
            "with cryptography's private_bytes/public_bytes (PEM)."
        )
    if not isinstance(path, (str, os.PathLike)):  # else pathlib's TypeError
        raise ConfigError(
            f"{fn}({printable(repr(path)[:80])}): expected the artifact directory as a str or "
            f"a pathlib.Path; got a value of type {type(path).__name__}."
        )
    path, file = Path(path), Path(key)
    shown = _call(call, path)
    if not os.path.isfile(file):  # os.path's: False where Path's raises (a name too long)
        raise ConfigError(
            f"{what}: {printable(str(file)[:300])} is not a key file ({_there(file)}); expected "
            f"the PEM file of an elliptic-curve {kind} key. Pass the path of one."
        )
    if os.path.islink(path):  # swapped after the check, it would name another directory
        raise ArtifactError(
            f"{shown}: the path is a symbolic link; an artifact is signed and verified at its "
            f"own path. Pass the directory it points to: {printable(repr(os.path.realpath(path)))}."
        )
    if not os.path.isdir(path):
        raise ArtifactError(
            f"{shown}: the path is not an artifact directory; there is nothing to {verb}. Pass the "
            "directory written by symjax_mlp.export."
        )
    try:
        with open(file, "rb") as f:  # the user's own file (a link followed): a PEM is < 64 kB
            data = f.read(1 << 16)
        got = pem.load_pem_private_key(data, None) if private else pem.load_pem_public_key(data)
        ok = isinstance(got, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey)
        held = None if ok else f"an {type(got).__name__}"
    except (ValueError, TypeError) as e:  # TypeError: an encrypted private key
        held = f"no PEM {kind} key ({printable(str(e).split('. ')[0][:120])})"
        if not private and b"-----BEGIN CERTIFICATE-----" in data:  # sm.sign signs by key
            held = "a certificate, not a key (its key: openssl x509 -pubkey -noout -in FILE)"
    except OSError as e:  # a regular file no read of which succeeds: permissions, /proc's
        held = f"nothing this process can read ({printable(e.strerror or str(e))[:120]})"
    if held:
        arg = f"{fn}({keyword}={printable(repr(str(file))[:300])})"
        want = (
            "private key to sign with, unencrypted (e.g. cryptography's "
            "ec.generate_private_key(ec.SECP256R1())). Pass such a key."
            if private
            else "public key whose private key signed the artifact (symjax_mlp.sign signs "
            "with such keys only). Pass that public key."
        )
        raise ConfigError(
            f"{arg}: the file holds {held}; expected the PEM file of the elliptic-curve {want}"
        )
    return path, file


def snapshot(path: Path, call: tuple[str, str]) -> dict[str, tuple[int, ...]]:
    """``{relative path: (device, inode, size, ctime_ns, is a file)}`` of each entry under
    ``path``; ArtifactError for a symlink, FIFO or device inside, or past :data:`MAX_ENTRIES`,
    begun with ``call`` (:func:`_call`)."""
    head, done = _call(call, path), "signed" if call[0].endswith(".sign") else "verified"
    out: dict[str, tuple[int, ...]] = {}
    todo = [path]
    while todo:
        directory = todo.pop()
        try:  # a path past PATH_MAX (directories nested thousands deep) fails to stat
            with os.scandir(directory) as listing:
                more = itertools.islice(listing, MAX_ENTRIES + 1 - len(out))
                entries = [(e.path, e.stat(follow_symlinks=False)) for e in more]
        except OSError as e:
            rel = os.path.relpath(directory, path)
            raise ArtifactError(
                f"{head}: {'the directory' if rel == '.' else printable(rel[:300])} cannot be "
                f"read ({e.strerror or e}); nothing was {done}. Pass the directory written by "
                "symjax_mlp.export, as it wrote it."
            ) from None
        for entry, info in entries:
            if len(out) >= MAX_ENTRIES:
                raise ArtifactError(
                    f"{head}: the directory holds more than {MAX_ENTRIES} files; it is not an "
                    "artifact. Pass the directory written by symjax_mlp.export."
                )
            rel = os.path.relpath(entry, path)
            if stat.S_ISDIR(info.st_mode):
                todo.append(Path(entry))
            elif not stat.S_ISREG(info.st_mode):
                raise ArtifactError(
                    f"{head}: {printable(rel[:300])} is not a regular file (a symlink, FIFO or "
                    f"device); a signed artifact holds only files. Nothing was {done}."
                )
            file = stat.S_ISREG(info.st_mode)
            out[rel] = (info.st_dev, info.st_ino, info.st_size, info.st_ctime_ns, file)
    return out


def sign(path: str | os.PathLike[str], private_key: str | os.PathLike[str]) -> Path:
    """Signs every file of an artifact directory with an elliptic-curve private key.

    Writes ``path/model.sig`` with the OpenSSF ``model-signing`` package
    (``pip install 'symjax_mlp[sign]'``), offline. Sign after the export is final: any later
    change to the directory makes :func:`verify_signature` refuse it.

    Args:
      path: the artifact directory.
      private_key: a PEM file of an elliptic-curve private key (e.g. made with
        ``cryptography``'s ``ec.generate_private_key(ec.SECP256R1())``).

    Returns:
      The signature file.

    Raises:
      ArtifactError: ``path`` is not a directory of plain files.
      ConfigError: ``model-signing`` is missing, or ``private_key`` is not a key file.
    """
    config, call = _config("signing"), ("symjax_mlp.sign", "private_key")
    path, key = _checked(path, private_key, private=True, call=call)
    snapshot(path, call)
    with tempfile.TemporaryDirectory() as scratch:  # a signature there before stays till done
        try:
            config.use_elliptic_key_signer(private_key=key).sign(path, Path(scratch, SIGNATURE))
        except (ValueError, TypeError, OSError) as e:
            if isinstance(e, OSError) and (fix := exhausted(e)):  # a limit of this process's
                raise ArtifactError(
                    f"{_call(call, path)}: model-signing could not finish ({e.strerror}), so "
                    f"nothing was signed; any {SIGNATURE} there before is unchanged. {fix}"
                ) from e
            raise ConfigError(
                f"{_call(call, path)}: model-signing failed: {printable(str(e))}"
            ) from e
        try:
            write_file_atomic(path / SIGNATURE, Path(scratch, SIGNATURE).read_bytes())
        except OSError as e:
            fix = exhausted(e) or "Remove what is there, or make room there."
            raise ArtifactError(
                f"{_call(call, path)}: {SIGNATURE} cannot be written ({e.strerror or e}); "
                f"anything there before is unchanged. {fix}"
            ) from None
    return path / SIGNATURE


def verify_signature(path: str | os.PathLike[str], public_key: str | os.PathLike[str]) -> None:
    """Checks that every file of ``path`` is what the holder of ``public_key``'s private key
    signed with :func:`sign`, and nothing more: no file added, removed or changed.

    Args:
      path: the artifact directory.
      public_key: a PEM file of the elliptic-curve public key.

    Raises:
      ArtifactError: the artifact is unsigned, a file was added, removed or changed, or it was
        signed with another key.
      ConfigError: ``model-signing`` is missing, or ``public_key`` is not a key file.
    """
    check(path, public_key, call=("symjax_mlp.verify_signature", "public_key"))


#: model-signing's "Hash mismatch for 'manifest.json'", in a list's repr: its quotes escaped
#: (\'manifest.json\') where the message also holds a double quote (a digest's bytes may)
_MISMATCH = re.compile(r"Hash mismatch for \\?'([^'\\]{1,200})\\?'")


def check(
    path: str | os.PathLike[str], public_key: str | os.PathLike[str], call: tuple = _LOAD
) -> Callable[[], None]:
    """:func:`verify_signature`; returns ``unchanged()``, which raises if any file of ``path``
    changed since (a loader calls it after reading the files). ``call``: the public function
    that was called and its keyword that took the key, ``("symjax_mlp.load",
    "verify_signature")`` unless given."""

    def sized() -> None:  # the signature verified, before a file is hashed: refused unread, a
        signed = _digests(copy.read_bytes())  # file resized (huge) or the manifest changed
        try:
            data = read_regular(path / MANIFEST, limit=MAX_MANIFEST_BYTES, error=ArtifactError)
        except FileNotFoundError:  # model-signing names it
            return
        if MANIFEST not in signed:  # no sizes to trust: its files are refused below, unread
            return
        if sha256(data) != signed[MANIFEST]:
            raise ArtifactError(f"it signs other contents of {MANIFEST}")  # the rest unread
        if resized := _resized(data, before):
            raise ArtifactError(resized)

    config = _config("verifying", sized)
    path, key = _checked(path, public_key, private=False, call=call)
    before, head = snapshot(path, call), _call(call, path)
    if SIGNATURE not in before:
        raise ArtifactError(
            f"{head}: the artifact is not signed (no {SIGNATURE}), and a public key was given: "
            "refusing it. Ask its author to sign it with symjax_mlp.sign(path, private_key), or "
            "load it without verify_signature= if you trust where it came from."
        )
    size, file = before[SIGNATURE][2], before[SIGNATURE][4]
    if size > MAX_SIGNATURE_BYTES or not file:
        what = f"has more than {MAX_SIGNATURE_BYTES} bytes" if file else "is a directory"
        raise ArtifactError(
            f"{head}: {SIGNATURE} {what}; it is no signature. Ask its author to sign it again "
            "with symjax_mlp.sign(path, private_key)."
        )
    changed = f"{head}: the artifact changed while it was verified and read; load it again."
    with tempfile.TemporaryDirectory() as scratch:  # model-signing reads a path: the bytes
        copy = Path(scratch, SIGNATURE)  # verified are then the very bytes parsed below
        try:
            copy.write_bytes(read_regular(path / SIGNATURE, limit=MAX_SIGNATURE_BYTES,
                                          error=ArtifactError))  # fmt: skip
        except (FileNotFoundError, ArtifactError):  # a regular file of that size a moment ago
            raise ArtifactError(changed) from None
        try:  # files it does not sign are refused below, never hashed (a 1 TB sparse one)
            verifier = config.set_ignore_unsigned_files(True)
            verifier.use_elliptic_key_verifier(public_key=key).verify(path, copy)
        except ArtifactError as e:  # sized()'s
            raise _refused(head, key, str(e)) from None
        except Exception as e:  # model_signing, sigstore and cryptography raise their own types
            files = _MISMATCH.findall(str(e))  # not their digests
            why = f"{type(e).__name__}: {str(e)[:400].rstrip('. ')}"
            why = f"it signs other contents of {', '.join(files[:8])}" if files else why
            if not files and "Key mismatch" in str(e):  # the files may be as signed: the key is not
                raise ArtifactError(
                    f"{head}: the signature {SIGNATURE} does not verify with {printable(str(key))}"
                    ": it was made with another key (model-signing's Key mismatch), whose public "
                    "key this is not: refusing it. Ask its author for that public key."
                ) from None
            raise _refused(head, key, why) from None
        signed = _digests(copy.read_bytes())
    added = sorted(f for f, entry in before.items() if entry[4] and f not in {*signed, SIGNATURE})
    if added:
        raise _refused(head, key, f"it does not sign {', '.join(added[:8])}")

    def unchanged(manifest: Any = None) -> None:
        """Raises if a file's metadata changed, or ``manifest`` (as a loader parsed it) is not
        the one signed: a write through a shared mmap changes bytes and no metadata."""
        if snapshot(path, call) != before:
            raise ArtifactError(changed)
        if manifest is not None and json.dumps(manifest) != _signed_manifest(path, signed):
            raise ArtifactError(changed)  # (None: the signed bytes are no JSON)

    unchanged()
    return unchanged


def _refused(head: str, key: Path, why: str) -> ArtifactError:
    return ArtifactError(
        f"{head}: the signature {SIGNATURE} does not verify with {printable(str(key))}: "
        f"{printable(why)}. The artifact was changed after it was signed, or signed by someone "
        "else: refusing it."
    )


def _digests(bundle: bytes) -> dict[str, str]:
    """``{file: sha256}`` that a verified ``model.sig`` signs ({} if not model-signing's)."""
    try:
        payload = json.loads(bundle)["dsseEnvelope"]["payload"]
        resources = json.loads(base64.b64decode(payload))["predicate"]["resources"]
        return {r["name"]: r["digest"] for r in resources if r["algorithm"] == "sha256"}
    except (ValueError, KeyError, TypeError):
        return {}


def _resized(manifest: bytes, before: dict[str, tuple]) -> str | None:
    """Which file the signed ``manifest`` (its bytes, as read once) lists at another size than
    it has now (``before``'s), said; ``None`` if none."""
    try:
        files = json.loads(manifest, object_pairs_hook=unique_pairs).get("files", {})
        for name, entry in sorted(files.items()):
            if name in before and before[name][4] and before[name][2] != entry["bytes"]:
                return (f"{name} has {before[name][2]:,} bytes, where the manifest it signs "
                        f"lists {entry['bytes']:,} (refused unread)")  # fmt: skip
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError):  # no manifest
        pass  # load reads: refused there
    return None


def _signed_manifest(path: Path, signed: dict[str, str]) -> str | None:
    """``json.dumps`` of the manifest read again, if its bytes have the sha256 ``signed``
    records (else ``None``, as for bytes that are no JSON, which load's reading refuses)."""
    try:
        data = read_regular(path / MANIFEST, limit=MAX_MANIFEST_BYTES, error=ArtifactError)
        if sha256(data) == signed.get(MANIFEST):
            return json.dumps(json.loads(data, object_pairs_hook=unique_pairs))
    except (FileNotFoundError, ValueError, UnicodeDecodeError, RecursionError):
        pass
    return None
