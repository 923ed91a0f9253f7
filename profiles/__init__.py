"""The built-in profiles, shipped in the wheel as the package `engine.builtin_profiles`
(this folder is mapped onto it in pyproject.toml). Users add their own TOML files in
the config dir's `profiles/`."""
