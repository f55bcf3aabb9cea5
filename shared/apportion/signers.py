"""The services' signers from their settings: a key file, or the development keyring.

A node agent signs its reports with one key per hosted node (:func:`report_signer`); the dispatcher signs its
decisions and commands with the key of ``service:dispatcher`` (:func:`decision_signer`). In production each
key is a file that ops registered; on a development stack the keyring makes and registers the missing ones
(:func:`apportion.client.enrol`, over Kafka), which is why these sit above the client and not in
:mod:`apportion.identity`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from apportion.client import enrol
from apportion.domain.admission import DISPATCHER, node_principal
from apportion.identity.keys import BatchSigner, Identity, ReportSigner, keyring_dir, node_key_file


def report_signer(
    node_ids: Iterable[str],
    *,
    key_dir: Path | None = None,
    bootstrap: str | None = None,
    now: Any = None,
) -> ReportSigner:
    """The signer of a node agent's reports: one key per hosted node, from settings.

    With ``key_dir`` (the agent's ``APPORTION_NODE_KEY_DIR``): each node's
    identity file ``<key_dir>/<node_id>.json`` (user ``node:<node_id>``; made
    by ``apportion keys init --node NODE_ID``, its public key registered by ops
    with ``apportion keys register node:NODE_ID PUBKEY``). Otherwise the
    development keyring (:func:`apportion.identity.keys.keyring_dir`), which makes and registers the
    missing ones (:func:`apportion.client.enrol`, event time ``now``: the agent's clock).

    Raises:
        LookupError: no key directory and no keyring, or a node's key file is missing.
        ValueError: a key file is not that node's identity.
    """
    ids = list(node_ids)
    if key_dir is not None:
        out = {}
        for nid in ids:
            path = node_key_file(key_dir, nid)
            if not path.is_file():
                raise LookupError(
                    f"no key file {path} for node {nid!r}: make it with `apportion keys init --node {nid} "
                    f"--file {path}` and have ops register its public key"
                )
            ident = Identity.load(path)
            if ident.user != node_principal(nid):
                raise ValueError(f"{path} signs as {ident.user!r}, not {node_principal(nid)!r}")
            out[nid] = ident
        return ReportSigner(out)
    if keyring_dir() is None:
        raise LookupError(
            "a node agent signs its reports: set APPORTION_NODE_KEY_DIR to the directory of its nodes' key "
            "files (or, on a development stack, APPORTION_KEYRING)"
        )
    return ReportSigner(dict(zip(ids, enrol([node_principal(n) for n in ids], bootstrap=bootstrap, now=now))))


def decision_signer(*, key_file: Path | None = None, bootstrap: str | None = None, now: Any = None) -> BatchSigner:
    """The signer of the dispatcher's decisions and commands (principal ``service:dispatcher``), from settings.

    With ``key_file`` (the dispatcher's ``APPORTION_DISPATCHER_KEY``): that
    identity file (made by ``apportion keys init --service dispatcher``, its
    public key registered by ops with ``apportion keys register
    service:dispatcher PUBKEY``); every instance (leader and standbys) holds
    the same key. Otherwise the development keyring (:func:`apportion.identity.keys.keyring_dir`),
    which makes and registers it on first use (:func:`apportion.client.enrol`;
    a stack registers it as ops before the dispatcher starts).

    Raises:
        LookupError: no key file and no keyring, or the key file is missing.
        ValueError: the key file is not the dispatcher's identity.
    """
    if key_file is not None:
        if not key_file.is_file():
            raise LookupError(
                f"no key file {key_file} for the dispatcher: make it with `apportion keys init --service "
                f"dispatcher --file {key_file}` and have ops register its public key"
            )
        ident = Identity.load(key_file)
        if ident.user != DISPATCHER:
            raise ValueError(f"{key_file} signs as {ident.user!r}, not {DISPATCHER!r}")
        return BatchSigner(ident)
    if keyring_dir() is None:
        raise LookupError(
            "the dispatcher signs its decisions: set APPORTION_DISPATCHER_KEY to its key file (or, on a "
            "development stack, APPORTION_KEYRING)"
        )
    return BatchSigner(enrol([DISPATCHER], bootstrap=bootstrap, now=now)[0])
