"""A storage root checked before any work: written where it says, or refused.

A malformed URI, a missing fsspec package, a bucket that does not exist, no credentials or a read-only directory
are refused before a command writes a byte, so nothing is ever written somewhere other than where the root says
(``s3:/bucket`` is not a local folder named ``s3:``).
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import fsspec

from kiln_core.storage import Location, resolve
from kiln_core.storage_settings import StorageFailure, StorageRejection, as_environment_failure

__all__ = ["BUCKET_PROTOCOLS", "check_storage_root"]

BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# ``s3:/bucket`` (one slash) or ``gs:bucket``: a protocol fsspec knows, which a plain path would turn into a
# local directory named ``s3:``.
_SCHEME_WITHOUT_SLASHES = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):(?!//)")


def check_storage_root(uri: str, *, field: str = "storage_root") -> Location:
    """Refuse a storage root that kiln-flows could not write where it says, before any work is done.

    Only what can be known without writing a byte of output: the URI is a URI (``s3:/bucket`` is not a local
    directory named ``s3:``), fsspec has the package for its protocol, an object store's bucket exists and the
    credentials can see it, and a local root is (or can become) a directory this process may create files in.

    Args:
        uri: The storage root (a local path or fsspec URI).
        field: How the caller names it in a message (``--out``, ``storage_root``).

    Returns:
        The resolved root.

    Raises:
        StorageRejection: ``invalid_uri`` (a malformed URI), ``unknown_protocol``, ``storage_package_missing``,
            ``storage_bucket_missing`` (the bucket does not exist), ``out_not_directory`` (a file is in the way).
        StorageFailure: ``storage_error`` — no credentials, access refused, an unreachable endpoint, a read-only
            local directory: the environment, not the input (exit 3, as the same failure later would be).

    Example:
        >>> check_storage_root("s3:/bucket/kiln", field="--out")
        Traceback (most recent call last):
        ...
        kiln_core.storage_settings.StorageRejection: [invalid_uri] field --out: s3:/bucket/kiln is not a URI (a scheme takes two slashes: s3://bucket/kiln); as a path it would be a local directory named s3:
    """
    _check_uri_form(uri, field)
    try:
        location = resolve(uri)
    except StorageRejection as error:
        raise StorageRejection(error.code, error.message, field=field) from None
    if location.is_local:
        _check_local_root(location.path, uri, field)
    elif _protocols(location.fs) & BUCKET_PROTOCOLS:
        _check_bucket(location, uri, field)
    return location


def _check_uri_form(uri: str, field: str) -> None:
    typo = _SCHEME_WITHOUT_SLASHES.match(uri) if "://" not in uri else None
    if typo is not None and typo["scheme"] in fsspec.available_protocols():
        scheme = typo["scheme"]
        meant = f"{scheme}://{uri[len(scheme) + 1:].lstrip('/')}"
        raise StorageRejection("invalid_uri", f"{uri} is not a URI (a scheme takes two slashes: {meant}); as a path "
                               f"it would be a local directory named {scheme}:", field=field)
    if "://" in uri:
        protocol, rest = uri.split("://", 1)
        if protocol in BUCKET_PROTOCOLS and not rest.strip("/"):
            raise StorageRejection("invalid_uri", f"{uri} names no bucket ({protocol}://BUCKET/PREFIX)", field=field)


def _check_local_root(path: str, uri: str, field: str) -> None:
    """The root is a directory or can be made one, and a file can be created at its nearest existing folder.

    The probe creates and removes an empty folder: permission bits say nothing for root, while a read-only
    mount or a pseudo file system refuses root too."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise StorageRejection("out_not_directory", f"{uri} {where}; {field} names a directory (the storage root)",
                               field=field)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kiln-flows-write-check-", dir=existing))
    except OSError as error:
        raise StorageFailure(f"cannot create {uri}: {existing} is not writable ({error.strerror or error})",
                             field=field) from None


def _check_bucket(location: Location, uri: str, field: str) -> None:
    bucket = location.path.split("/", 1)[0]
    try:
        location.fs.info(bucket)
    except FileNotFoundError:
        raise StorageRejection("storage_bucket_missing", f"bucket {bucket!r} of {uri} does not exist (or these "
                               "credentials cannot see it); create it, or name an existing one", field=field) from None
    except Exception as error:  # noqa: BLE001 - classified: credentials and network are the environment's
        failure = as_environment_failure(error)
        if failure is None:
            raise
        raise StorageFailure(f"cannot use bucket {bucket!r} of {uri}: {failure.message}", field=field) from error


def _protocols(fs: Any) -> set[str]:
    protocol = getattr(fs, "protocol", ())
    return set(protocol if isinstance(protocol, (tuple, list)) else [protocol])
