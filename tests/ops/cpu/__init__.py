"""Tests of ea_hf.ops.cpu: a package, so that its test modules may share names with those of the other kernel
folders, as the kernels' own modules do."""
