"""The store password, kept off every command line.

A Redis password can come from three places; a process's command line is readable by every user of the
host (``ps``, ``/proc/<pid>/cmdline``), so only the first should be used in production:

1. a file: the URL option ``password_file=PATH`` (``--remote-kv-store-password-file PATH`` adds it; the
   data plane, spawned or a service, reads the same file from the URL it gets);
2. the environment variable ``SRKV_STORE_PASSWORD`` (``env.store_password``), inherited by the scheduler
   and data-plane processes; used when the URL names neither a password nor a file;
3. the URL's userinfo (``redis://[user]:password@host``): still accepted, with one warning at start
   (``url_password_warning``), since it is then on the serving process's command line.

A URL with both a password and ``password_file`` is refused (``ValueError``). The password itself never
appears in an error, a log line or a child's argv (``base.redact_url`` for URLs).
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from urllib.parse import unquote, urlencode, urlsplit

from .. import env

log = logging.getLogger(__name__)

PASSWORD_FILE_OPTION = "password_file"
MAX_PASSWORD_FILE_BYTES = 4096
PASSWORD_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


class PasswordFileError(ValueError):
    """The password file is missing, unreadable, not a regular file, empty or too long."""


def read_password_file(path: str | Path) -> str:
    """The password in ``path``: its text without the trailing newline (a file of one line)."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise PasswordFileError(f"store password file {str(p)!r} is not a regular file")
        if st.st_size > MAX_PASSWORD_FILE_BYTES:
            raise PasswordFileError(
                f"store password file {str(p)!r} is {st.st_size} bytes (max {MAX_PASSWORD_FILE_BYTES})"
            )
        text = p.read_bytes().decode("utf-8").rstrip("\r\n")
    except OSError as e:
        raise PasswordFileError(f"store password file {str(p)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PasswordFileError(f"store password file {str(p)!r} is not UTF-8 text") from None
    if not text:
        raise PasswordFileError(f"store password file {str(p)!r} is empty")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("store password file %s is accessible by every user; chmod 600 it", p)
    return text


def store_password(url: str, opts: dict[str, str]) -> str | None:
    """The password of a Redis store URL (``opts``: its query options): see the module docstring."""
    in_url = urlsplit(url).password
    path = opts.get(PASSWORD_FILE_OPTION)
    if in_url and path:
        raise ValueError(f"the store URL names a password and {PASSWORD_FILE_OPTION}=; give one of them")
    if in_url:
        return unquote(in_url)
    if path:
        return read_password_file(path)
    return env.store_password()


def with_password_file(url: str, path: str) -> str:
    """``url`` (a Redis store URL without a password) with the option ``password_file=path``."""
    scheme = url.split("://", 1)[0].lower().removeprefix("faulty+") if "://" in url else ""
    if scheme not in PASSWORD_SCHEMES:
        raise ValueError(f"a store password file needs a Redis store URL ({', '.join(PASSWORD_SCHEMES)})")
    if urlsplit(url).password:
        raise ValueError("the store URL already holds a password; give it in the file only")
    sep = "&" if "?" in url else "?"
    return url + sep + urlencode([(PASSWORD_FILE_OPTION, path)])


def url_password_warning(url: str) -> str | None:
    """The warning to log once at start when ``url`` holds a password (on the command line), else None."""
    if "://" not in url or not urlsplit(url).password:
        return None
    return (
        "the remote KV store password is part of the store URL, so it shows in the process list (ps) of "
        "every user of this host; put it in a file (--remote-kv-store-password-file PATH, or the URL option "
        f"{PASSWORD_FILE_OPTION}=PATH) or in the environment variable {env.STORE_PASSWORD} instead"
    )
