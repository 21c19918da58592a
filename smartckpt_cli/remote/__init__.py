"""The remote tier: committed checkpoints replicated in the background to a second repository of
the store's own format (an object store, or a directory), and restored from it when the local
copy is gone or damaged.

Layout under the remote URL (every object is written once and never modified)::

    blobs/ab/ab12...cd                     the same content-addressed blobs as the local store
    manifests/<step>-<id>.json             the same manifests
    journal/<seq>-<event>-<tag>.json       one object per journal event (init, commit, prune)
    parts/<step>-<id>-r<rank>.json         several ranks: rank <rank>'s part of a step is remote

The replica is a repository of the store's own format on any backend
(:mod:`smartckpt_cli.store.storage`: a directory or an object store), its journal in the objects
layout (:mod:`smartckpt_cli.store.log`). Modules: ``replica`` (opening one), ``parts`` (the
rule for a step written by several ranks), ``replicator`` (the background uploader; its round's
plan in ``plan``, the multi-rank round in ``part_round``, its status file in ``status``),
``fetch`` (restore's downloads), ``check`` (inspect, verify, prune on the remote side) and
``tier`` (the glue the manager calls).
"""

from smartckpt_cli.remote.replica import display_url, open_remote, replica_journal

__all__ = ["display_url", "open_remote", "replica_journal"]
