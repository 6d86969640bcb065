class GDecodeError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


class NonFiniteLogits(GDecodeError):
    """The logits of a decode step hold NaN or Inf (after penalties and temperature)."""

    def __init__(self, step: int, backend: str):
        super().__init__(f"the logits of generated token {step} hold NaN or Inf ({backend} backend): "
                         "the model's weights or activations are not finite")
        self.step, self.backend = step, backend
