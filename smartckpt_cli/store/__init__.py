"""Bytes on disk, and the commit point. No torch.

:mod:`.blobs` (content-addressed blobs: the xxh3-128 of their bytes names them; written once),
:mod:`.codec` (bytes to encoded chunks and back: byte shuffle, zstd, hashes), :mod:`.journal`
(manifests and the append-only journal: a checkpoint exists once its ``commit`` line does),
:mod:`.checkpoints` (the committed checkpoints, newest first, with their manifests verified),
:mod:`.directory` (a store on disk: ``dir`` and ``meta_dir``, opened once, and its single-writer
lock), :mod:`.retention` (what to keep, decided from the journal, then carried out),
:mod:`.storage` (where bytes go: local files, fsync, O_DIRECT).
"""
