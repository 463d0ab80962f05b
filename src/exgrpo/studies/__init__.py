"""Research tooling: multi-seed studies (`exgrpo experiment`), their pre-registered statistics, report plots and the
demo report. The only place matplotlib is imported."""
