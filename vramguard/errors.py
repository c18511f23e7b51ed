"""Typed errors. Each names the field, the value given, the limit or accepted values, and the fix.

The library raises these; the CLI prints them and exits with the class's ``exit_code``. The exit codes, in one
place: 1 a check or plan that failed (``--exit-code``); 2 a bad value (:class:`InvalidValue`); 3 an unknown model or
card or an unreadable config (:class:`UnknownModel`, :class:`UnknownGpu`, :class:`ConfigError`), a command that
needs a CUDA GPU on a machine without one (:class:`NoCudaGpu`), or a server whose device failed
(:data:`EXIT_DEVICE_ERROR`); 4 a request that cannot fit (:class:`Infeasible`); 70 an internal error
(:data:`EXIT_INTERNAL`, ``EX_SOFTWARE`` of sysexits.h); 141 the reader of the output went away, as ``| head`` does
(:data:`EXIT_CLOSED_PIPE`).
"""

from __future__ import annotations

EXIT_DEVICE_ERROR = 3  # a server's engine stopped on a fault of the device
EXIT_INTERNAL = 70  # an exception vramguard did not expect
EXIT_CLOSED_PIPE = 141  # stdout's reader closed the pipe: 128 + SIGPIPE (13), what a shell reports for `yes | head`


SHOWN_CHARS = 200  # the longest value an error message repeats in full


def shown(value: object) -> str:
    """``repr(value)``, or for a longer one its first 80 characters and the length of the value's text."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:80]}... ({len(str(value)):,} characters)"


class VramguardError(Exception):
    """Base class: ``field`` is the option or setting at fault, ``value`` what was given, ``fix`` what to do."""

    exit_code = 2

    def __init__(self, field: str, value: object, accepted: str, fix: str | None = None):
        self.field = field
        self.value = value
        self.accepted = accepted
        self.fix = fix
        super().__init__(self.render())

    def render(self, field: str | None = None) -> str:
        """The two-line message, with ``field`` (e.g. the CLI flag) in place of the library's field name; a value
        longer than :data:`SHOWN_CHARS` (a whole prompt) is shown by its start and its length."""
        msg = f"{field or self.field}: {shown(self.value)} is not valid; accepted: {self.accepted}."
        return msg + (f"\nfix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict:
        return {"type": type(self).__name__, "field": self.field, "value": str(self.value),
                "accepted": self.accepted, "fix": self.fix, "exit_code": self.exit_code}


class InvalidValue(VramguardError):
    """A user-given value outside what is accepted (unit, range, choice)."""


class UsageError(InvalidValue):
    """A command line refused as it was read (an option repeated, a size typed as two words), whose message is not
    of :meth:`VramguardError.render`'s form: ``text`` is the two lines said; field, value, accepted and fix are
    kept apart for a machine reader (``--format json``)."""

    def __init__(self, field: str, value: object, accepted: str, fix: str | None, text: str):
        self.text = text
        super().__init__(field, value, accepted, fix)

    def render(self, field: str | None = None) -> str:
        return self.text


class UnknownModel(VramguardError):
    """The model is not a local folder, a config.json, a cached model id or a catalog name."""

    exit_code = 3


class HubError(UnknownModel):
    """The Hugging Face Hub (or its local cache) could not give the model's metadata: ``accepted`` says what
    happened (gated, not found, no network), ``fix`` what to do."""

    def render(self, field: str | None = None) -> str:
        msg = f"{field or self.field}: {self.value!r}: {self.accepted}."
        return msg + (f"\nfix: {self.fix}" if self.fix else "")


class UnknownGpu(VramguardError):
    """The GPU name is not in the catalog."""

    exit_code = 3


class ConfigError(VramguardError):
    """A config.json lacks a field memory depends on, or holds a value that cannot be right."""

    exit_code = 3


class NoCudaGpu(VramguardError):
    """The work needs a CUDA GPU and this machine has none that torch can use: nothing the user gave is wrong.
    ``field`` names the work (``profile``), ``accepted`` why none was found, ``fix`` what to do."""

    exit_code = 3

    def render(self, field: str | None = None) -> str:
        msg = f"{field or self.field}: needs a CUDA GPU; none found ({self.accepted})."
        return msg + (f"\nfix: {self.fix}" if self.fix else "")


class Infeasible(VramguardError):
    """A solve asked for a value that cannot exist (e.g. the weights alone exceed the memory)."""

    exit_code = 4


class NotPlannable(ConfigError):
    """transformers' own forward could not be replayed for these settings (the message names the operator and what
    it raised): the architecture does not support them (e.g. a static cache with ALiBi), or the replay meets a
    value it cannot decide."""


class NotModelled(Exception):
    """Internal to the replay: the forward needs a value that meta tensors do not have and the replay's policy does
    not decide (the message says which operator); surfaced to callers as :class:`NotPlannable`."""
