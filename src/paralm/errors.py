"""The one exception type for mistakes a user can fix (bad config, missing file, corrupt checkpoint).

The CLI turns it into a single readable line and exit code 2; anything else is a bug and keeps its
traceback.
"""

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A problem in the user's input, with a message that names the field or file and the fix."""
