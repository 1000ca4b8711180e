package bench

import "syscall"

// childAttr makes a memory-mode child receive SIGKILL when this process dies, however it
// dies.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
