"""Config files; a package so an installed `probe` finds them as pkg://probe.conf."""
