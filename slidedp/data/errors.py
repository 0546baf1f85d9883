"""The data wing's one error: data that cannot be trained on, named where it lies (file, line or row)."""


class DataError(ValueError):
    pass
