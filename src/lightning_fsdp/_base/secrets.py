"""Secrets in ``storage_options``: the one place that decides which values are never shown, and how they are masked.

``storage_options`` are the keyword arguments of an fsspec filesystem, and some of them are credentials (s3fs's
``key``/``secret``/``token``, adlfs's ``account_key``/``sas_token``/``connection_string``, gcsfs's ``token``). Every
place that shows the options (the strategy's config repr, LightningCLI's ``config.yaml`` and ``--print_config``, the
errors about a bad value) shows :func:`mask_secrets` of them, never the values themselves.

A masked value is :data:`MASK`. It cannot be used again: a ``config.yaml`` written with masks, run again, reaches
:func:`refuse_masked`, which says that the secret was masked and where to put it (the environment or a profile).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "StorageOptions", "is_secret_key", "mask_secrets", "shown", "hidden", "refuse_masked"]

MASK = "***"

# Words that make a key a secret wherever they appear in it (`aws_secret_access_key`, `sas_token`, `clientSecret`).
# "key" covers s3fs's `key` (the access key id: not secret alone, but half of the pair, and masked with it).
_SECRET_WORDS = frozenset({
    "key", "keys", "secret", "secrets", "token", "tokens", "password", "passwd", "pwd", "passphrase", "credential",
    "credentials", "sas", "signature", "auth", "authorization", "cookie", "session",
})
# Whole keys that hold a secret without a secret word: an Azure connection string carries the account key.
_SECRET_KEYS = frozenset({"connection_string", "conn_str", "connectionstring"})
# gcsfs's `token` also names a method, not a secret; those values stay visible, so a config with them re-runs.
_PUBLIC_VALUES = frozenset({"anon", "google_default", "cloud", "browser", "cache"})


# A URL with a user and password in it (`https://user:pass@host`).
_USERINFO = re.compile(r"://[^/@\s]+@")


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)  # camelCase: `accountKey` -> `account_Key`
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if word]


def is_secret_key(name: Any) -> bool:
    """Whether the option ``name`` holds a secret (``key``, ``secret``, ``token``, ``password``, ``sas_token``,
    ``account_key``, ``credential``, ``connection_string``, ... in any case and spelling)."""
    text = str(name)
    return text.lower() in _SECRET_KEYS or any(word in _SECRET_WORDS for word in _words(text))


def _masked_value(value: Any) -> Any:
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value in _PUBLIC_VALUES):
        return value  # not a secret: `anon: true`, `token: google_default`
    return MASK


def mask_secrets(options: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of ``options`` with every secret value replaced by :data:`MASK`, nested mappings too (s3fs's
    ``client_kwargs={"aws_secret_access_key": ...}``); the other values are kept, so the copy still says which
    endpoint and which options were used."""
    masked: dict[Any, Any] = {}
    for name, value in options.items():
        if is_secret_key(name):
            masked[name] = _masked_value(value)
        elif isinstance(value, Mapping):
            masked[name] = mask_secrets(value)
        elif isinstance(value, (list, tuple)):
            masked[name] = type(value)(mask_secrets(v) if isinstance(v, Mapping) else v for v in value)
        else:
            masked[name] = value
    return masked


def shown(value: Any) -> str:
    """How an error shows a ``storage_options`` value: a mapping with its secrets masked; anything else as it is
    (``'http://host:9000'``, which helps to see the mistake) unless it names a secret (``"key=...,secret=..."``),
    then by its type alone."""
    if isinstance(value, Mapping):
        return repr(mask_secrets(value))
    text = repr(value)
    names_one = any(word in _SECRET_WORDS or word == "pass" for word in _words(text))
    if names_one or any(k in text.lower() for k in _SECRET_KEYS) or _USERINFO.search(text):
        return f"<a {type(value).__name__}, not shown: it may hold a secret>"
    return text


class _Hidden:
    def __init__(self, value: Any) -> None:
        self._value = value

    def __repr__(self) -> str:
        return shown(self._value)


def hidden(value: Any) -> Any:
    """``value`` for a message that formats it with ``repr`` (``errors.bad_argument``): shown as :func:`shown`."""
    return _Hidden(value)


def _masked_paths(options: Mapping[Any, Any], prefix: str = "") -> list[str]:
    found = []
    for name, value in options.items():
        if isinstance(value, str) and value == MASK:
            found.append(f"{prefix}{name}")
        elif isinstance(value, Mapping):
            found += _masked_paths(value, f"{prefix}{name}.")
    return found


def refuse_masked(options: Mapping[Any, Any], where: str) -> None:
    """Raise when a value of ``options`` is :data:`MASK`: it was read back from a dump (LightningCLI's
    ``config.yaml``) where the secret was masked, and would otherwise reach the store as a wrong credential."""
    masked = _masked_paths(options)
    if masked:
        raise ValueError(
            f"`{where}` holds {', '.join(repr(m) for m in masked)} = {MASK!r}: a secret that was masked when the"
            " configuration was saved (LightningCLI's config.yaml never holds credentials). HINT: give the secret"
            " through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS,"
            " AZURE_STORAGE_ACCOUNT_KEY, ...) or a profile (`storage_options={'profile': 'name'}` with ~/.aws/credentials),"
            " and remove it from `storage_options`."
        )


class StorageOptions(dict):
    """A ``storage_options`` dict that never shows its secrets: its ``repr`` (and so a dataclass's, an error's, a
    log's) is :func:`mask_secrets` of it. The strategies' ``storage_options`` annotation names it so LightningCLI's
    config dump masks them too (see :mod:`lightning_fsdp._fronts.mixin`); any plain dict is accepted as well."""

    def __repr__(self) -> str:
        return repr(mask_secrets(self))

    __str__ = __repr__
