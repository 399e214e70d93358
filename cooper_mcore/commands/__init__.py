"""The ``cooper`` subcommands' handlers: each takes the parsed arguments and calls the library.

:mod:`cooper_mcore.cli` parses the command line and imports the one module here that the chosen
subcommand needs (its ``HANDLERS`` table), so that ``cooper --help``, ``--version`` and a mistyped
flag do not pay for importing megatron-core, torch and transformers. Each handler returns the exit
code (``None``: 0) or raises; :func:`cooper_mcore.cli.main` turns the user's errors into one line.
Importing this package imports megatron-core first, with its ``torch.compile`` wrappers deferred to
their first call (:mod:`cooper_mcore.compat.startup`): a second less per process.
"""

from __future__ import annotations

import errno
import logging
import os

from cooper_mcore.atomic import check_output_path
from cooper_mcore.compat.startup import import_megatron

import_megatron()  # before any handler imports it: megatron's torch.compile wrappers deferred (compat.startup)

logger = logging.getLogger("cooper_mcore")


def check_output_folder(path: str) -> None:
    """Fail before any work when the folder ``path`` (to be created or filled) cannot be written.

    The nearest existing path on the way to ``path`` must be a folder this process may write into.
    A symlink whose target does not exist yet (a run folder pointed at another disk before its
    first run) gets its target created, as the run would create ``path`` itself.

    Raises:
        NotADirectoryError: that path is a file.
        PermissionError: the folder is not writable (its permissions, or a read-only file system).
        ValueError: ``path`` is a symlink whose missing target cannot be created (naming both).
    """
    if os.path.islink(path) and not os.path.exists(path):
        _create_link_target(path)
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(probe).f_flag & os.ST_RDONLY else errno.EACCES
        raise PermissionError(code, os.strerror(code), probe)


def _create_link_target(link: str) -> None:
    """Create the missing target folder of the symlink ``link``.

    Raises:
        ValueError: the target cannot be created (a loop of links, a file in the way, no permission).
    """
    target = os.path.realpath(link)
    try:
        if os.path.islink(target):  # realpath stops at a loop of links
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        check_output_folder(os.path.dirname(target))
        os.makedirs(target, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{link} is a symlink to {target}, which does not exist and cannot be created "
                         f"({e.strerror or e}): create it, or point the link elsewhere") from None
    logger.info("%s is a symlink to %s, which did not exist: created it", link, target)


def check_output_file(path: str) -> None:
    """Fail before any work when ``path`` (a file to write) is a folder or cannot be written.

    Raises:
        IsADirectoryError: ``path`` is a folder.
        NotADirectoryError / PermissionError: as :func:`check_output_folder` for its folder.
        ValueError: ``path`` exists and is not a regular file (:func:`cooper_mcore.atomic.check_output_path`).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    check_output_folder(os.path.dirname(os.path.abspath(path)))
    check_output_path(path)  # a device or FIFO there would be replaced by the atomic writer
