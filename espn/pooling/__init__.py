"""Token pooling: clustering a document's vectors (`cluster`), recording which encoder vectors
each stored vector merged (`groups`), and reading that back as passage spans (`spans`)."""
