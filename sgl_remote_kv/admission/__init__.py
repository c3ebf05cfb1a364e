"""Admission of requests whose prefix may be in the remote tier: one state machine (``parked.py``), one
queue with park / poll / abort (``queue.py``), the TP agreement every poll goes through
(``agreement.py``), what to look up and fetch (``plan.py``), the install of fetched KV
(``install.py``) and the interfaces it needs from the engine (``ports.py``). SGLang-independent: the
SGLang seam implements the ports."""

from .agreement import Agreement
from .parked import ParkedRequest, Phase
from .ports import AdmissionSettings, Collaborators
from .queue import WaitingForKV

__all__ = ["AdmissionSettings", "Agreement", "Collaborators", "ParkedRequest", "Phase", "WaitingForKV"]
