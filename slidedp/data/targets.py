"""The target that trains nothing, kept apart from the loss (which imports torch): the rows are packed with it."""

IGNORE_INDEX = -100  # targets equal to this contribute no loss and no gradient (as in F.cross_entropy)
