"""The resume check (:class:`ResumeGuard`).

Every rank resumes from the same checkpoint and step, with its own data position and
random state.
"""
