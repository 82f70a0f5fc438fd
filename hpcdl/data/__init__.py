"""Data sets, sampling, minibatch loading and conversion tools."""
