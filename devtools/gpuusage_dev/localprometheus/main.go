// The bcrypt hash of the password read from stdin, as a Prometheus web config's
// basic_auth_users wants it (Python's standard library has no bcrypt). The lowest cost: the
// hash guards a loopback server for the length of a test.
package main

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/crypto/bcrypt"
)

func main() {
	password, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "reading the password:", err)
		os.Exit(1)
	}
	hash, err := bcrypt.GenerateFromPassword(password, bcrypt.MinCost)
	if err != nil {
		fmt.Fprintln(os.Stderr, "hashing the password:", err)
		os.Exit(1)
	}
	fmt.Println(string(hash))
}
