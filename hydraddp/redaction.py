"""What of a config is a secret, and the config with its secrets masked: for MLflow's params and tags, the saved
``config.yaml``, checkpoints and the LoggedModel's rebuild alike (pure Python: config, tracking and train use it).

A key is a secret by its *words* (split at ``_``, ``-``, ``.`` and camelCase), not by a substring: ``api_key``,
``hfToken``, ``db.password`` and ``client_secret`` are; ``pad_token_id``, ``max_tokens``, ``tokenizer``,
``num_passes`` and ``keypoints`` are not. A value is a secret when it came from ``${oc.env:...}`` or sits anywhere
under a secret key, in dicts and in lists alike. A URI's password is masked in any value, under any key
(``postgresql://user:***@host/db``), since a tracking or database URI is a value people paste whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

REDACTED = "***redacted***"
URI_PASSWORD_MASK = "***"
ENV_INTERPOLATION = re.compile(r"\$\{oc\.env:")

# Words that make a key a secret on their own, and pairs of consecutive words that do.
SECRET_WORDS = frozenset({"password", "passwd", "pass", "passphrase", "pwd", "secret", "secrets", "token", "credential",
                          "credentials", "auth", "authorization", "apikey", "bearer"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("ssh", "key")})
# "token" names a vocabulary entry, not a credential, after a special token's role (a tokenizer's pad_token) or
# before an id or index (pad_token_id, token_type_ids).
TOKEN_NOT_A_SECRET_AFTER = frozenset({"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "special",
                                      "decoder", "image", "vision", "boi", "eoi"})
TOKEN_NOT_A_SECRET_BEFORE = frozenset({"id", "ids", "idx", "index", "type", "types", "len", "length", "count"})
# scheme://user:password@host (the password is what follows the first ':' of the part before '@').
URI_WITH_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<password>[^@\s/]+)(?=@)")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def key_words(key: str) -> list[str]:
    """``"hfApiKey"`` -> ``["hf", "api", "key"]``; ``"pad_token_id"`` -> ``["pad", "token", "id"]``."""
    return [word.lower() for part in re.split(r"[_\-.\s]+", str(key)) for word in _WORD.findall(part)]


def is_secret_key(dotted: str) -> bool:
    """True when any part of ``dotted`` names a password, token, secret, credential, auth or API/access/private key."""
    for part in str(dotted).split("."):
        words = key_words(part)
        for index, word in enumerate(words):
            following = words[index + 1] if index + 1 < len(words) else None
            preceding = words[index - 1] if index else None
            if word == "token" and (following in TOKEN_NOT_A_SECRET_BEFORE or preceding in TOKEN_NOT_A_SECRET_AFTER):
                continue
            if word in SECRET_WORDS or (word, following) in SECRET_PAIRS:
                return True
    return False


def mask_uri_password(value: str) -> str:
    """``"postgresql://u:pw@h/db"`` -> ``"postgresql://u:***@h/db"``; any other string as it is."""
    return URI_WITH_PASSWORD.sub(lambda m: m["head"] + URI_PASSWORD_MASK, value)


def _walk(tree: Any, prefix: str = ""):
    """(dotted path, value) of every leaf; list items are ``path.<index>``, as OmegaConf's select names them."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        yield prefix, tree
        return
    for key, value in items:
        yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))


def secret_paths(unresolved: dict[str, Any]) -> set[str]:
    """Dotted paths (list items by index) whose value comes from ``${oc.env:...}``, or that sit anywhere under a
    secret key (at any depth, through lists)."""
    return {path for path, value in _walk(unresolved)
            if (isinstance(value, str) and ENV_INTERPOLATION.search(value)) or is_secret_key(path)}


def redact(resolved: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of ``resolved`` (dicts, lists, scalars) with the value of every path in ``secrets`` and under every
    secret key replaced by a marker, and every URI's password masked."""
    secrets = frozenset(secrets)

    def masked(node: Any, path: str, key: str) -> Any:
        if path in secrets or is_secret_key(key):
            return REDACTED
        if isinstance(node, dict):
            return {k: masked(v, f"{path}.{k}" if path else str(k), str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(masked(v, f"{path}.{i}" if path else str(i), "") for i, v in enumerate(node))
        return mask_uri_password(node) if isinstance(node, str) else node

    return masked(resolved, "", "")


def redact_overrides(overrides: list[str], secrets: Iterable[str] = ()) -> list[str]:
    """Command-line overrides with the value of every secret key masked (``key=value`` -> ``key=***redacted***``): a
    secret key at any depth, a key in ``secrets``, or a key above one (``db={password: x}``,
    ``hooks=[{api_key: x}]``); a URI's password is masked in any value."""
    secret_keys = set(secrets)
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")
        above = any(path.startswith(f"{bare}.") for path in secret_keys)
        if sep and (bare in secret_keys or above or is_secret_key(bare) or _names_a_secret_inside(value)):
            override = f"{key}={REDACTED}"
        elif sep:
            override = f"{key}={mask_uri_password(value)}"
        out.append(override)
    return out


def _names_a_secret_inside(value: str) -> bool:
    """A dict or list value typed on the command line (``[{name: n, api_key: x}]``) that holds a secret key."""
    return any(is_secret_key(key) for key in re.findall(r"[{,]\s*([A-Za-z_][\w.-]*)\s*:", value))
