"""gloo's connection notes, taken out of a launched process's output lines
(``phalanx launch`` keeps them only with ``--verbose``)."""

# gloo's note once a process has connected to the others; "#" is a number.
_GLOO_NOTE = (
    "[Gloo] Rank # is connected to # peer ranks. Expected number of connected "
    "peer ranks is : #"
)


def _walk_note(text: str, at: int) -> tuple[int, int]:
    """How much of `text`'s start continues gloo's note from position `at`:
    (characters of `text`, the position in the note reached)."""
    used = 0
    while at < len(_GLOO_NOTE) and used < len(text):
        if _GLOO_NOTE[at] == "#":
            digits = len(text[used:]) - len(text[used:].lstrip("0123456789"))
            if not digits:
                break
            used += digits
        elif text[used] != _GLOO_NOTE[at]:
            break
        else:
            used += 1
        at += 1
    return used, at


class GlooNotes:
    """Takes gloo's connection notes out of one stream's lines.

    gloo's C++ side writes its note in pieces, one write per part, so the
    program's own output can land between them: a line can hold the note
    and the program's text, and a note cut by another writer's line end
    goes on at the start of the next line. The note's text is removed
    wherever it is; a line left empty by that (or the stray line end after
    it) is dropped, and everything else is the program's own.
    """

    def __init__(self) -> None:
        self._at = 0  # where in an unfinished note the stream is (0: none)
        self._after = False  # the previous line held (part of) a note

    def __call__(self, line: str) -> str | None:
        """`line` without gloo's text; None where nothing else was in it."""
        text, removed = line.rstrip("\n"), False
        if self._at:
            used, at = _walk_note(text, self._at)
            self._at = at if used and at < len(_GLOO_NOTE) else 0
            text, removed = text[used:], used > 0
        start = text.find("[Gloo]")
        while start >= 0:
            used, at = _walk_note(text[start:], 0)
            if start + used == len(text) and at < len(_GLOO_NOTE):
                self._at = at  # the note goes on in a later line
            text, removed = text[:start] + text[start + used :], True
            start = text.find("[Gloo]", start)
        stray = self._after and not text.strip()
        self._after = removed
        if (removed or stray) and not text.strip():
            return None
        return text + line[len(line.rstrip("\n")) :] if removed else line
