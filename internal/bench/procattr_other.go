//go:build !linux

package bench

import "syscall"

// childAttr: without Pdeathsig, a memory-mode child is killed by the deferred kill only.
// (Memory mode reads /proc, so it runs on Linux anyway.)
func childAttr() *syscall.SysProcAttr { return nil }
