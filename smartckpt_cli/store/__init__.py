"""Repositories: bytes on any backend, and the commit point. No torch.

:mod:`.blobs` (content-addressed blobs: the xxh3-128 of their bytes names them; written once),
:mod:`.codec` (bytes to encoded chunks and back: byte shuffle, zstd, hashes), :mod:`.journal`
(manifests and the journal: a checkpoint exists once its ``commit`` line does; :mod:`.lines` a
line's bytes, :mod:`.log` its two layouts: a file of lines, or one object per event),
:mod:`.commit` (the one code that writes manifests and commit lines), :mod:`.checkpoints` (the
committed checkpoints, newest first, with their manifests verified), :mod:`.directory` (a
repository opened once, by directory or URL, and its single-writer lock), :mod:`.retention`
(what to keep, decided from the journal), :mod:`.gc` (the one sweep that removes the rest),
:mod:`.storage` (where bytes go: a directory, or an object store through fsspec).
"""
